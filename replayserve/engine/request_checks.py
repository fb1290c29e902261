"""What a request must satisfy before an engine admits it, from the engine's configuration alone."""

from __future__ import annotations

from replayserve.config import EngineConfig
from replayserve.sampling_params import SamplingParams
from replayserve.structured.grammar import check_structured_outputs


def validate_request(config: EngineConfig, has_tokenizer: bool, prompt_token_ids: list[int],
                     params: SamplingParams) -> None:
    """Raises ValueError for a request an engine of ``config`` cannot serve (``has_tokenizer``: the
    model has one, which stop strings need). Reads the configuration only, so a front end in
    another process than the engine checks requests with it before sending them."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: it needs at least one token")
    vocab = config.model.vocab_size
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}")
    limit = config.resolved_max_model_len
    if len(prompt_token_ids) >= limit:
        raise ValueError(
            f"the prompt has {len(prompt_token_ids)} tokens; max_model_len={limit} leaves room for "
            f"at most {limit - 1} prompt tokens"
        )
    if params.stop and not has_tokenizer:
        raise ValueError("SamplingParams.stop needs a tokenizer; the model directory has no tokenizer.json")
    for option in ("logprobs", "prompt_logprobs"):
        if (k := getattr(params, option)) is not None and k > vocab:
            raise ValueError(f"SamplingParams.{option}={k} is more than the vocabulary's {vocab} tokens")
    if any(t >= vocab for t in params.stop_token_ids):
        raise ValueError(f"SamplingParams.stop_token_ids must be < the vocabulary size {vocab}, "
                         f"got {list(params.stop_token_ids)}")
    if params.structured_outputs is not None:
        if not has_tokenizer:
            raise ValueError("SamplingParams.structured_outputs needs a tokenizer; the model directory has no "
                             "tokenizer.json")
        check_structured_outputs(params.structured_outputs)

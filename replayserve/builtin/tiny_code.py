"""The built-in model `replayserve/tiny-code`: a small Nemotron-H (with one MTP layer) trained on the
Python standard library by `scripts/train_default_model.py`, shipped in `tiny_code_checkpoint/`, and
the held-out checks that tie the shipped weights to the numbers its training recorded.

The model directory holds, beside config.json, the shards and the tokenizer: `heldout_sample.json`
(the heads of held-out stdlib files, from the Python that trained it) and `eval.json` (what the
training script measured on them with this engine: `heldout_perplexity`, `function_headers`).
"""

from __future__ import annotations

import codeop
import json
import math
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from replayserve.llm import LLM

TINY_CODE = "replayserve/tiny-code"
TINY_CODE_DIR = Path(__file__).parent / "tiny_code_checkpoint"
BUILTIN_MODELS = {TINY_CODE: TINY_CODE_DIR}
HELDOUT_SAMPLE = "heldout_sample.json"
EVAL_RESULTS = "eval.json"
# The model completes code and never saw a conversation: its chat template (tokenizer_config.json)
# writes the messages' contents one after another, as one Python file, so a chat request continues
# the code as a completion of the same text does. (The default `<|role|>` lines read to it as HTML.)
CODE_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"

# A one-line `def` header (any indentation, optional return annotation and trailing comment).
_HEADER = re.compile(r"^[ \t]*(async[ \t]+)?def[ \t]+\w+[ \t]*\(.*\)[ \t]*(->[^:#]+)?:[ \t]*(#.*)?$")


def resolve_model(model: str) -> str:
    """A built-in name (`replayserve/tiny-code`) -> its directory; anything else is returned as it
    is (a model directory). A local directory of the same name wins over the built-in."""
    builtin = BUILTIN_MODELS.get(model)
    if builtin is None or Path(model).is_dir():
        return model
    if not (builtin / "config.json").is_file():
        raise FileNotFoundError(f"the built-in model {model} has no weights in {builtin}; reinstall replayserve "
                                "or write them with scripts/train_default_model.py --install")
    return str(builtin)


def heldout_texts(model_dir: str | Path) -> list[str]:
    """The held-out file heads shipped with the model (`heldout_sample.json`), in order."""
    return [f["text"] for f in json.loads((Path(model_dir) / HELDOUT_SAMPLE).read_text())["files"]]


def eval_results(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / EVAL_RESULTS).read_text())


def perplexity_windows(llm: LLM, texts: Sequence[str], num_files: int, tokens: int) -> list[list[int]]:
    """The first `tokens` tokens of each of the first `num_files` texts that have that many, each
    after the end-of-sequence token (how training saw a file start), so every token is scored."""
    assert llm.tokenizer is not None
    eos = llm.config.model.eos_token_ids[0]
    windows = []
    for text in texts:
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= tokens:
            windows.append([eos, *ids[:tokens]])
        if len(windows) == num_files:
            return windows
    raise ValueError(f"only {len(windows)} held-out texts have {tokens} tokens; {num_files} were asked for")


def heldout_perplexity(llm: LLM, windows: Sequence[Sequence[int]]) -> float:
    """exp(mean negative log-likelihood) of every token after the first of each window, from the
    engine's own prompt log-probabilities."""
    from replayserve.sampling_params import SamplingParams

    outs = llm.generate([{"prompt_token_ids": list(w)} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    total, count = 0.0, 0
    for window, out in zip(windows, outs, strict=True):
        assert out.prompt_logprobs is not None
        for token, entry in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            assert entry is not None
            total -= entry[token].logprob
            count += 1
    return math.exp(total / count)


def function_headers(texts: Sequence[str], limit: int) -> list[str]:
    """Up to `limit` prompts: one-line `def` headers, dedented, without their newline, taken round
    robin (every text's first header, then every text's second, ...) so that many prompts still
    come from many files. The model writes the newline itself: byte-level BPE merges a newline with
    the next line's indentation, so a prompt that ended in a bare newline would announce an
    unindented line."""
    per_text = [[line.strip() for line in text.splitlines() if _HEADER.match(line)] for text in texts]
    headers = []
    for rank in range(max(map(len, per_text), default=0)):
        headers.extend(found[rank] for found in per_text if rank < len(found))
    return headers[:limit]


def completes_as_python(header: str, continuation: str) -> bool:
    """Whether the body generated after a one-line header is Python: the text up to the end of the
    function (the first non-blank line after the header that is not indented) or else up to its
    last complete line must compile or be a valid beginning of Python (`codeop`: an open bracket,
    string or block); at least one body line is needed."""
    first, *lines = (header + continuation).split("\n")
    end = next((i for i, line in enumerate(lines) if line.strip() and not line[0].isspace()), None)
    body = lines[:end] if end is not None else lines[:-1]  # the last line may be cut mid-token
    if not any(line.strip() for line in body):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarning (an invalid escape) is not an error
        try:
            codeop.compile_command("\n".join([first, *body]) + "\n", symbol="exec")
        except (SyntaxError, ValueError, OverflowError):
            return False
    return True

"""The offline API: `LLM(model=dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from replayserve.build import build_engine
from replayserve.chat import ChatTemplate, Message, encode_rendered
from replayserve.config import ENGINE_OPTIONS
from replayserve.engine.request import Request
from replayserve.outputs import CompletionOutput, RequestOutput, to_logprobs
from replayserve.sampling_params import SamplingParams
from replayserve.tokenizer import Tokenizer, check_unicode

Prompt = str | dict[str, Any]
# The prompt forms `generate` takes, as vLLM spells them (a string, TextPrompt, TokensPrompt).
PROMPT_FORMS = "a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}"

class LLM:
    """A loaded model and its engine.

    model: a Hugging Face model directory, or the built-in "replayserve/tiny-code" (a small
    Nemotron-H with an MTP layer trained on the Python standard library, shipped with the package).

    Engine options, each also a flag of `replayserve generate | serve | demo` but warmup (declared
    once in `replayserve/config/options.py`; a test holds these lines equal to it):
    dtype: weights and activations; auto: bfloat16 on CUDA, float32 on CPU.
    device: where the model runs (default: cuda when torch sees a GPU, else cpu).
    max_num_seqs: requests decoded together.
    max_num_batched_tokens: tokens per step: prefill chunks plus decode rows.
    max_model_len: prompt plus output tokens (default: the model's limit, max_position_embeddings in
    config.json).
    block_size: tokens per KV block.
    kv_cache_dtype: the KV cache's dtype: auto (the model's) or fp8 (float8_e4m3fn, half the bytes of a 16-bit
    cache; keys and values are divided by the checkpoint's k_scale and v_scale, else 1.0, before rounding;
    the Triton attention kernels widen it in registers, the scales folded into the softmax scale and the output).
    num_kv_blocks: KV blocks (default: on CUDA sized by gpu_memory_utilization, on CPU enough for
    max_num_seqs full sequences).
    gpu_memory_utilization: on CUDA, the share of the GPU's memory, in (0, 1], this engine may use: KV
    blocks and cached Mamba states that are not given fill what the weights and an activation reserve
    leave (the numbers are logged); on CPU the defaults stay.
    ssm_backend: Mamba2 and Gated DeltaNet decode: baseline (the state read and written every step) or
    replay (ReplaySSM: a checkpoint plus rings of the last replay_window tokens' inputs, the state
    written on a flush).
    replay_window: ReplaySSM's window: tokens between flushes, from tokens per step (1 + speculative
    tokens) to 64 (default for Mamba2 32, or 16 with speculative decoding; for Gated DeltaNet 32 or 16
    minus tokens per step).
    enable_prefix_caching: reuse the KV blocks and Mamba states of cached prompt prefixes.
    mamba_cache_mode: which Mamba states prefix caching keeps: none (so a hybrid model never hits),
    align (where a step ends on a block boundary; prefill chunks end on them) or all (at every block
    boundary); needs enable_prefix_caching (default: align when prefix caching is on and the model has
    Mamba layers, logged, else none).
    num_mamba_cache_slots: state slots for cached Mamba states (default: max_num_seqs).
    mamba_block_size: tokens between cached Mamba states, a multiple of block_size; prefix hits are
    multiples of it (default: lcm(block_size, the model's SSD chunk size)).
    speculative: speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 3}; methods
    ngram, draft (with "model": a draft checkpoint) and mtp, further keys those of SpeculativeConfig:
    decode rows verify up to num_speculative_tokens proposed tokens per step, losslessly.
    enforce_eager: on CUDA, run decode steps eagerly instead of replaying a CUDA graph per padded batch
    size (1, 2, 4, 8, multiples of 16 up to max_num_seqs; captured at start by the warm-up).
    async_scheduling: plan and launch the next plain decode step while the device runs this one, its
    input tokens taken from this step's on the device; outputs are the same. Steps with prefill chunks,
    Mamba boundary states (prefix caching) or penalties / min_tokens run synchronously; not with
    speculative decoding or tensor parallelism.
    tensor_parallel_size: processes (GPUs on CUDA) the model is split over (heads, inner dimensions,
    vocabulary): this one (rank 0) runs the engine and starts the others, which run their slices of each
    step; gloo on the CPU, NCCL on CUDA (one GPU per rank). `close()` stops them.
    cpu_threads: on the CPU, torch's intra-op threads per rank (torch's setting is process-wide);
    default: OMP_NUM_THREADS when set, else the cores idle at the first engine's start-up, at least 1
    (torch's one per core collapses on a busy machine; cpu_threads.py says why); the choice is logged;
    refused on CUDA. `llm.cpu_threads` keeps the choice.
    warmup: on CUDA, before returning, compile the Triton kernels and capture the CUDA graphs that
    serving will run, with dummy requests that leave no trace (Engine.warm_up; what it ran and its time
    are logged), instead of during the first requests; the CPU compiles nothing and skips it.
    `llm.engine.warm_up()` runs it anyway.
    """

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        ssm_backend: str = "baseline",
        replay_window: int | None = None,
        enable_prefix_caching: bool = False,
        mamba_cache_mode: str | None = None,
        num_mamba_cache_slots: int | None = None,
        mamba_block_size: int | None = None,
        speculative: dict | None = None,
        enforce_eager: bool = False,
        async_scheduling: bool = False,
        tensor_parallel_size: int = 1,
        cpu_threads: int | None = None,
        warmup: bool = True,
    ) -> None:
        # The keyword arguments but model: a test holds them to the table of engine options.
        options = {name: value for name, value in locals().items() if name in ENGINE_OPTIONS}
        built = build_engine(model, options)
        self.config, self.engine, self.tokenizer = built.config, built.engine, built.tokenizer
        self.workers, self.cpu_threads = built.workers, built.cpu_threads
        try:
            self.chat_template = ChatTemplate.from_dir(built.model_dir)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stops the tensor-parallel workers (also done at exit); the LLM cannot generate after it."""
        if self.workers is not None:
            self.workers.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prompt_ids(self, prompt: Prompt, name: str) -> list[int]:
        """The token ids of one prompt; `name` is what an error calls it ("prompt", "prompts[3]")."""
        if isinstance(prompt, dict) and set(prompt) == {"prompt"}:
            prompt = prompt["prompt"]
            name += "['prompt']"
            if not isinstance(prompt, str):
                raise ValueError(f"{name} must be a string, got {prompt!r:.80}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; the model directory has no tokenizer.json "
                                 "(pass {'prompt_token_ids': [...]} instead)")
            check_unicode(prompt, name)
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple):
                raise ValueError(f"{name}['prompt_token_ids'] must be a list of ints")
            return list(ids)
        raise ValueError(f"{name} must be {PROMPT_FORMS}; got {_describe(prompt)}")

    def get_metrics(self) -> dict[str, float]:
        """Engine counters since start: prefix-cache queries and hits in tokens (overall, and per
        group: attention and mamba), steps, generated tokens, preemptions."""
        return self.engine.get_metrics()

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Replies to one conversation (a list of {"role", "content"} dicts) or to a list of them.
        Each is rendered with `chat_template`, else the model directory's (tokenizer_config.json),
        else `replayserve.chat.DEFAULT_CHAT_TEMPLATE`, then generated like a prompt; an output's
        `prompt` is the rendered text, as vLLM's is. tools (OpenAI's list) and chat_template_kwargs
        (e.g. {"enable_thinking": False}) are the template's variables, as in vLLM."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; the model directory has no tokenizer.json")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = self.chat_template if chat_template is None else ChatTemplate(chat_template,
                                                                                 self.chat_template.special_tokens)
        texts = [template.render(c, add_generation_prompt, tools, chat_template_kwargs)  # type: ignore[arg-type]
                 for c in conversations]
        prompts = [{"prompt_token_ids": encode_rendered(t, self.tokenizer)} for t in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        return [dataclasses.replace(out, prompt=text) for out, text in zip(outputs, texts, strict=True)]

    def _run(self, groups: list[list[Request]], use_tqdm: bool) -> None:
        """Steps until every request is done; the bar shows prompts done (all of a prompt's `n`
        completions finished) and the prefill (input) and generated (output) tokens per second,
        updated every step, as vLLM's does."""
        engine = self.engine
        prefilled, generated, start = engine.num_prefill_tokens, engine.num_generated_tokens, time.perf_counter()
        shown = start
        prompt_of = {r.request_id: i for i, group in enumerate(groups) for r in group}
        unfinished = [len(group) for group in groups]
        with tqdm(total=len(groups), disable=not use_tqdm, desc="Processed prompts", dynamic_ncols=True) as bar:
            while engine.has_unfinished():
                done = 0
                for request in engine.step():
                    prompt = prompt_of[request.request_id]
                    unfinished[prompt] -= 1
                    done += unfinished[prompt] == 0
                now = time.perf_counter()
                if done or now - shown > 0.5 or not engine.has_unfinished():
                    elapsed, shown = max(now - start, 1e-9), now
                    bar.set_postfix_str(f"input: {(engine.num_prefill_tokens - prefilled) / elapsed:.0f} tok/s, "
                                        f"output: {(engine.num_generated_tokens - generated) / elapsed:.0f} tok/s",
                                        refresh=not done)
                bar.update(done)

    def get_tokenizer(self) -> Tokenizer | None:
        """The model directory's tokenizer (None when it has no tokenizer.json)."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order, each with `n` completions. Every prompt is validated
        before any is admitted. Requests share cached prefixes only with requests of the same
        ``cache_salt``."""
        if isinstance(prompts, str | dict):
            prompts, names = [prompts], ["prompt"]
        elif isinstance(prompts, bytes | bytearray | memoryview) or not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be {PROMPT_FORMS}, or a list of them; got {_describe(prompts)}")
        else:
            names = [f"prompts[{i}]" for i in range(len(prompts))]
        params = sampling_params or SamplingParams()
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(all_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(all_params)} SamplingParams")
        ids = [self._prompt_ids(p, name) for p, name in zip(prompts, names, strict=True)]
        for prompt_ids, p in zip(ids, all_params, strict=True):
            self.engine.validate(prompt_ids, p)
        requests: list[list[Request]] = []
        try:
            for prompt_ids, p in zip(ids, all_params, strict=True):
                requests.append([])
                for i in range(p.n):
                    requests[-1].append(self.engine.add_request(prompt_ids, p.for_completion(i), cache_salt))
            self._run(requests, use_tqdm)
        finally:
            for request in (r for group in requests for r in group):  # an interrupted call keeps no block or slot
                self.engine.abort(request)
        return [_output(prompt, group, self.tokenizer) for prompt, group in zip(prompts, requests, strict=True)]


def _output(prompt: Prompt, group: list[Request], tokenizer: Tokenizer | None) -> RequestOutput:
    decode = None if tokenizer is None else tokenizer.token_text
    completions = []
    for index, r in enumerate(group):
        assert r.finish_reason is not None
        logprobs, cumulative = None, None
        if r.params.logprobs is not None:
            logprobs = to_logprobs(r.output_logprobs, r.output_token_ids, r.output_ranks, decode)
            cumulative = sum(lp[t] for lp, t in zip(r.output_logprobs, r.output_token_ids, strict=True))
        completions.append(CompletionOutput(index, r.text, list(r.output_token_ids), cumulative, logprobs,
                                            r.finish_reason, r.stop_reason))
    first = group[0]
    prompt_logprobs = None
    if first.params.prompt_logprobs is not None and not first.needs_prompt_logprobs:  # an abort leaves them out
        prompt_logprobs = [None, *to_logprobs(first.prompt_logprobs, first.prompt_token_ids[1:], first.prompt_ranks,
                                              decode)]
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    return RequestOutput(first.request_id, text, first.prompt_token_ids,
                         completions, finished=True, prompt_logprobs=prompt_logprobs)


def _describe(value: object) -> str:
    """A refused prompt as an error shows it: bytes are named as such (they are not text until decoded)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return (f"{bytes(value)!r:.40} ({type(value).__name__}): bytes are not accepted; decode them to a string "
                "first (.decode())")
    return f"{value!r:.80} ({type(value).__name__})"

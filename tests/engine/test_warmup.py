"""Startup warm-up (`Engine.warm_up`, `engine/warmup.py`): it leaves no trace (every block and slot
free, no cached prefix, counters and request ids as before, the global generator untouched) and
changes no output (float64, CPU, both SSM backends, prefix caching, n-gram speculation, async
scheduling); it prepares every decode shape a step can take; serving after it launches no Triton
kernel variant it did not (on the CPU by each launch's compile-time key, through the interpreter;
on CUDA by Triton's own cache misses) and captures no graph."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.engine.cuda_graph import capture_buckets
from replayserve.layers.step_context import StepContext
from replayserve.ops.dispatch import force_triton
from tests.conftest import assert_pools_full

pytestmark = pytest.mark.warmup  # keeps LLM's warm-up on CUDA (tests/conftest.py turns it off elsewhere)

NGRAM = {"speculative": {"method": "ngram", "num_speculative_tokens": 2}}
PREFIX_ALL = {"enable_prefix_caching": True, "mamba_cache_mode": "all"}


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=gen).tolist()} for n in lengths]
    prompts.append(prompts[1])  # a prefix hit when caching is on
    prompts.append({"prompt_token_ids": prompts[0]["prompt_token_ids"] * 3})  # repeats: n-gram drafts
    return prompts


@pytest.mark.parametrize(("backend", "extra"), [
    ("baseline", {}), ("replay", {}), ("baseline", PREFIX_ALL), ("replay", PREFIX_ALL), ("baseline", NGRAM),
    ("replay", NGRAM), ("baseline", {"async_scheduling": True}),
], ids=["baseline", "replay", "baseline-prefix", "replay-prefix", "baseline-ngram", "replay-ngram", "baseline-async"])
def test_warm_up_leaves_no_trace_and_changes_no_output(tiny_model_dir: Path, backend: str, extra: dict) -> None:
    def build() -> LLM:
        return LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4,
                   max_num_batched_tokens=32, max_model_len=64, block_size=4, ssm_backend=backend,
                   replay_window=4, **extra)

    fresh, warmed = build(), build()
    untouched = fresh.get_metrics()
    rng = torch.get_rng_state()
    report = warmed.engine.warm_up()

    # It ran what it is for: the budget, every row count, the verify widths, the prefix hit.
    graphs = warmed.engine.runner.graphs
    assert report.graphs == (graphs.shapes if graphs is not None else ())
    assert report.prefill_tokens[-1] == 32 and report.decode_rows[-1] == 4
    assert report.verify_drafts == ((1, 2) if "speculative" in extra else ())
    assert report.prefix_hit == ("enable_prefix_caching" in extra)
    # ... and left nothing behind.
    assert_pools_full(warmed)
    cache = warmed.engine.cache
    assert cache.kv.num_cached == 0
    assert cache.states is None or cache.states.num_cached == 0
    assert warmed.get_metrics() == untouched
    assert torch.equal(torch.get_rng_state(), rng)

    prompts = _prompts(0, (5, 21, 30, 9, 2))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (fresh, warmed)]
    assert [o.request_id for o in outs[1]] == [o.request_id for o in outs[0]]
    assert [o.outputs[0].token_ids for o in outs[1]] == [o.outputs[0].token_ids for o in outs[0]]
    assert warmed.get_metrics() == fresh.get_metrics()  # the same hits, drafts and steps
    assert_pools_full(warmed)


@pytest.mark.parametrize("extra", [{"async_scheduling": True}, NGRAM], ids=["async", "ngram"])
def test_every_decode_shape_a_step_can_take_is_prepared(tiny_model_dir: Path, extra: dict) -> None:
    """The shapes prepared are every (bucket, width) the runner can pick: the bucket of each row
    count up to max_num_seqs (cuda_graph's own sizes), at width 1 and 1 + k."""
    llm = LLM(model=str(tiny_model_dir), dtype="float32", device="cpu", max_num_seqs=20, max_model_len=64,
              block_size=4, **extra)
    runner = llm.engine.runner
    if runner.graphs is None:  # speculation on the CPU: the graphs' fixed-shape path, run eagerly
        runner.graphs = runner.make_decode_graphs(capture=False)
    graphs = runner.graphs
    ran: list[tuple[int, int]] = []
    forward = graphs.forward

    def recording(ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        ran.append((ctx.num_decodes, ctx.uniform_decode))
        return forward(ids, ctx)

    graphs.forward = recording
    prepared = runner.prepare_for_serving()

    widths = {1, llm.config.tokens_per_step}
    picked = {(graphs.bucket(rows), width) for rows in range(1, llm.config.max_num_seqs + 1) for width in widths}
    assert {b for b, _ in picked} == set(capture_buckets(llm.config.max_num_seqs))
    assert set(prepared) == picked
    assert sorted(ran) == sorted(picked)  # each ran once, on pad rows
    assert_pools_full(llm)


def test_warm_up_refuses_a_busy_engine(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", device="cpu", max_num_seqs=2, max_model_len=32)
    llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        llm.engine.warm_up()


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("warmup-moe"), seed=0, layers="M*EM*E")


def _varied_workload(llm: LLM, seed: int) -> None:
    """Prompts of many lengths (chunked, mixed with decodes, repeated: prefix hits, repeating: n-gram
    drafts) and output lengths, so steps take many token and row counts."""
    gen = torch.Generator().manual_seed(seed)
    prompts = _prompts(seed, tuple(torch.randint(1, 85, (14,), generator=gen).tolist()))
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True)
              for n in torch.randint(1, 60, (len(prompts),), generator=gen)]
    llm.generate(prompts, params, use_tqdm=False)


def _launch_key(kernel, args: tuple, kwargs: dict) -> tuple:  # noqa: ANN001 - an InterpretedFunction
    """What Triton compiles a variant per (`triton.runtime.jit`): the kernel, its constexprs' values,
    each int's width and, unless `do_not_specialize` names it, whether it is 1 and whether 16
    divides it; each tensor's dtype and whether its address is a multiple of 16; the launch options."""
    sig = inspect.signature(kernel.fn)
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    unspecialized = set(kernel.kwargs.get("do_not_specialize") or ())
    key = []
    for name, value in bound.arguments.items():
        if "constexpr" in str(sig.parameters[name].annotation) or value is None or isinstance(value, bool | str):
            key.append((name, value))
        elif isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, int):
            wide = not -(2**31) <= value < 2**31
            key.append((name, wide, None if name in unspecialized else (value == 1, value % 16 == 0)))
        else:
            key.append((name, type(value).__name__))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters))
    return kernel.fn.__name__, tuple(key), options


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the test below counts Triton's own compiles")
@pytest.mark.parametrize(("backend", "extra"), [
    ("replay", {"max_num_seqs": 13, "max_num_batched_tokens": 77}),
    ("replay", {**PREFIX_ALL, "max_num_seqs": 6}),
    ("baseline", {"speculative": {"method": "ngram", "num_speculative_tokens": 3}, "max_num_seqs": 11}),
    ("baseline", {"enable_prefix_caching": True, "mamba_cache_mode": "align", "max_num_seqs": 24}),
], ids=["replay", "replay-prefix-all", "baseline-ngram", "baseline-prefix-align"])
def test_eager_steps_after_warm_up_launch_no_new_kernel_variant(moe_model_dir: Path, backend: str, extra: dict,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every op forced onto its Triton kernel (the CPU runs them in the interpreter) and each launch
    recorded by its compile-time key instead of run (the engine's control flow does not read the
    values); no decode graphs, so every step is eager. Serving a varied workload after the warm-up
    launches no key the warm-up did not. (The decode graphs' shapes are the test above's.)"""
    _assert_serving_launches_no_new_variant(moe_model_dir, backend, extra, monkeypatch, min_variants=20)


def _assert_serving_launches_no_new_variant(model_dir: Path, backend: str, extra: dict,
                                            monkeypatch: pytest.MonkeyPatch, min_variants: int) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    launched: dict[tuple, str] = {}
    phase = ["warm-up"]
    monkeypatch.setattr(InterpretedFunction, "run", lambda kernel, *args, grid, warmup, **kwargs:
                        launched.setdefault(_launch_key(kernel, args, kwargs), phase[0]))
    with force_triton():
        llm = LLM(model=str(model_dir), dtype="float32", device="cpu", max_model_len=256, ssm_backend=backend,
                  **{"max_num_batched_tokens": 64, **extra})
        vocab = llm.config.model.vocab_size  # the kernels leave their outputs unwritten: greedy tokens from zeros
        monkeypatch.setattr(llm.engine.runner.model, "compute_logits",
                            lambda hidden: hidden.new_zeros(len(hidden), vocab))
        llm.engine.warm_up()
        phase[0] = "serving"
        for seed in range(3):
            _varied_workload(llm, seed)
    late = [key for key, seen in launched.items() if seen == "serving"]
    assert len(launched) > min_variants and late == [], f"first launched while serving: {late}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles and CUDA graphs need a GPU")
@pytest.mark.parametrize(("backend", "extra"), [
    ("baseline", {}), ("replay", {}),
    ("replay", {**PREFIX_ALL, "num_kv_blocks": 160, "num_mamba_cache_slots": 32}),
    ("baseline", {"speculative": {"method": "ngram", "num_speculative_tokens": 3}}),
    ("replay", {"speculative": {"method": "ngram", "num_speculative_tokens": 3}}),
    ("replay", {"async_scheduling": True}), ("baseline", {"enforce_eager": True}),
], ids=["baseline", "replay", "replay-prefix", "baseline-ngram", "replay-ngram", "replay-async", "eager"])
def test_serving_after_warm_up_compiles_and_captures_nothing(moe_model_dir: Path, backend: str, extra: dict,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of many shapes (prefill chunks, mixed steps, every batch size, verify rows of any
    width, prefix hits) after `LLM`'s warm-up: Triton's cache-miss hook never fires and no decode
    graph is captured."""
    import triton

    llm = LLM(model=str(moe_model_dir), dtype="bfloat16", device="cuda", max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=256, ssm_backend=backend, **extra)
    graphs = llm.engine.runner.graphs
    captured = set(graphs._graphs) if graphs is not None else set()
    compiled: list[str] = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **info: compiled.append(info["repr"]))
    for seed in range(3):
        _varied_workload(llm, seed)
    assert compiled == [], f"compiled while serving: {compiled}"
    assert (set(graphs._graphs) if graphs is not None else set()) == captured
    assert_pools_full(llm)


@pytest.fixture(scope="module")
def gdn_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("warmup-gdn"), seed=0, family="qwen3_5")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the test below counts Triton's own compiles")
# A state grid of 16 tokens: the Qwen configs' default (lcm(block_size, chunk_size 128)) leaves the warm-up's
# prefix hit no grid point to publish in decode within max_model_len 256.
@pytest.mark.parametrize(("backend", "extra"), [
    ("replay", {**PREFIX_ALL, "max_num_seqs": 6, "mamba_block_size": 16}),
    ("baseline", {"speculative": {"method": "ngram", "num_speculative_tokens": 3}, "max_num_seqs": 11}),
    ("replay", {"speculative": {"method": "ngram", "num_speculative_tokens": 3}, "max_num_seqs": 5}),
], ids=["replay-prefix-all", "baseline-ngram", "replay-ngram"])
def test_gdn_eager_steps_after_warm_up_launch_no_new_kernel_variant(gdn_model_dir: Path, backend: str, extra: dict,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above on a Gated DeltaNet model: the varlen conv with and without captures, the
    decode and verify kernels of both GDN backends, ReplaySSM-GDN's flush and materialization."""
    _assert_serving_launches_no_new_variant(gdn_model_dir, backend, extra, monkeypatch, min_variants=10)


@pytest.fixture(scope="module")
def granite_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("warmup-granite"), seed=0, family="granite")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the test above counts Triton's own compiles")
@pytest.mark.parametrize(("backend", "extra"), [
    ("replay", {"max_num_seqs": 6}),
    ("baseline", {"speculative": {"method": "ngram", "num_speculative_tokens": 3}, "max_num_seqs": 11}),
], ids=["replay", "baseline-ngram"])
def test_granite_eager_steps_after_warm_up_launch_no_new_kernel_variant(granite_model_dir: Path, backend: str,
                                                                        extra: dict,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above on Granite 4.0-H (MoE, RoPE): its softmax routing, SwiGLU grouped GEMMs, RoPE
    and silu_mul kernels."""
    _assert_serving_launches_no_new_variant(granite_model_dir, backend, extra, monkeypatch, min_variants=20)


@pytest.fixture(scope="module")
def qwen_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("warmup-qwen-moe"), seed=0, family="qwen3_next")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the test above counts Triton's own compiles")
def test_qwen_moe_eager_steps_after_warm_up_launch_no_new_kernel_variant(qwen_moe_model_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above on Qwen3-Next's MoE: its routing over all experts and SwiGLU grouped GEMMs
    (`Runner.prepare_for_serving` sweeps its token counts)."""
    extra = {"max_num_seqs": 13, "max_num_batched_tokens": 77}
    _assert_serving_launches_no_new_variant(qwen_moe_model_dir, "replay", extra, monkeypatch, min_variants=20)

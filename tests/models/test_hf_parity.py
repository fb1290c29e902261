"""Our engine against Hugging Face transformers' NemotronHForCausalLM on tiny random checkpoints.

Log-probabilities are compared teacher-forced: HF runs ONE full forward over prompt + our generated
tokens, so a divergence is measured where it starts instead of compounding. Greedy tokens are compared
with HF ``generate``. Run with ``pytest -s`` to see the observed maximum differences.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

from tests.conftest import assert_pools_full

from .hf_reference import (
    DT_CLAMP_CONFIGS,
    HF_CONFIGS,
    hf_float64_exact,
    hf_greedy,
    hf_teacher_forced_logprobs,
    load_hf_model,
    make_hf_checkpoint,
)

CONFIG_NAMES = list(HF_CONFIGS)
NUM_NEW = 32
BLOCK_SIZE = 16
# All longer than every chunk_size (8/16) and than one KV block; 32 exactly fills two blocks, so its
# first decode token opens a fresh block. One batch holds all three.
PROMPT_LENS = (37, 32, 50)
F32_TOL = 1e-4
F64_TOL = 1e-9

_GREEDY_CACHE: dict[tuple, list[int]] = {}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> checkpoint dir; each HF_CONFIGS checkpoint is built once per session."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = make_hf_checkpoint(tmp_path_factory.mktemp(f"hf_{name}"), name)
        return built[name]

    return get


def _prompts(name: str, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    vocab = HF_CONFIGS[name]["vocab_size"]
    # Ids 0-2 are pad/bos/eos; keep prompts to ordinary tokens.
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


def _hf_greedy_cached(name: str, model_dir: Path, prompt: list[int]) -> list[int]:
    """HF float32 greedy; uncached forward for configs where HF's decode path skips the dt clamp."""
    key = (str(model_dir), tuple(prompt))
    if key not in _GREEDY_CACHE:
        use_cache = name not in DT_CLAMP_CONFIGS
        _GREEDY_CACHE[key] = hf_greedy(model_dir, prompt, NUM_NEW, torch.float32, use_cache=use_cache)
    return _GREEDY_CACHE[key]


def _engine_generate(
    model_dir: Path,
    dtype: str,
    prompts: list[list[int]],
    logprobs: int = 1,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 512,
) -> list:
    # Imported here so that the harness self-checks below run even while the engine is incomplete.
    from replayserve import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        device="cpu",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=BLOCK_SIZE,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outs) == len(prompts)
    for out in outs:
        assert out.finish_reason == "length"
        assert len(out.token_ids) == NUM_NEW
        assert len(out.logprobs) == NUM_NEW
    assert_pools_full(llm)
    return outs


def _check_teacher_forced(
    model_dir: Path, prompts: list[list[int]], outs: list, dtype: torch.dtype, tol: float
) -> tuple[float, float]:
    """Per generated token: our sampled-token logprob vs HF's, and our token is HF's (near-)argmax.

    Returns (max |logprob difference|, smallest HF top-1 minus top-2 gap seen).
    """
    max_diff, min_gap = 0.0, float("inf")
    for j, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        ref = hf_teacher_forced_logprobs(model_dir, prompt + out.token_ids, dtype)
        # Row len(prompt) - 1 + i predicts generated token i.
        rows = ref[len(prompt) - 1 : len(prompt) - 1 + NUM_NEW]
        top2 = rows.topk(2, dim=-1).values
        min_gap = min(min_gap, (top2[:, 0] - top2[:, 1]).min().item())
        for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert tok in lp, f"prompt {j} step {i}: sampled token {tok} missing from logprobs {lp}"
            want = rows[i, tok].item()
            diff = abs(lp[tok].logprob - want)
            max_diff = max(max_diff, diff)
            assert diff <= tol, f"prompt {j} step {i} token {tok}: ours {lp[tok].logprob!r} vs HF {want!r} ({diff:.3e})"
            best = rows[i].max().item()
            assert want >= best - tol, (
                f"prompt {j} step {i}: greedy picked {tok} (HF logprob {want:.6f}) but HF's argmax "
                f"{rows[i].argmax().item()} has {best:.6f}"
            )
    return max_diff, min_gap


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_parity_float32(name: str, checkpoint: Callable[[str], Path]) -> None:
    model_dir = checkpoint(name)
    prompts = _prompts(name)
    outs = _engine_generate(model_dir, "float32", prompts)
    for j, out in enumerate(outs):
        # Greedy with one logprob: the dict is exactly the sampled (= top-1) token.
        assert all(set(lp) == {tok} for tok, lp in zip(out.token_ids, out.logprobs, strict=True)), j
    max_diff, min_gap = _check_teacher_forced(model_dir, prompts, outs, torch.float32, F32_TOL)
    for j, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        want = _hf_greedy_cached(name, model_dir, prompt)
        first = next((i for i, (a, b) in enumerate(zip(out.token_ids, want, strict=True)) if a != b), None)
        assert out.token_ids == want, f"prompt {j}: greedy diverges from HF generate at step {first}"
    print(
        f"\n[{name}] float32: max |dlogprob| = {max_diff:.2e} (tol {F32_TOL:g}), greedy == HF generate "
        f"for {len(prompts)}x{NUM_NEW} tokens, min HF top1-top2 gap {min_gap:.1e}"
    )


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_parity_float64(name: str, checkpoint: Callable[[str], Path]) -> None:
    model_dir = checkpoint(name)
    prompts = _prompts(name)
    outs = _engine_generate(model_dir, "float64", prompts)
    max_diff, min_gap = _check_teacher_forced(model_dir, prompts, outs, torch.float64, F64_TOL)
    print(
        f"\n[{name}] float64: max |dlogprob| = {max_diff:.2e} (tol {F64_TOL:g}) over "
        f"{len(prompts)}x{NUM_NEW} tokens, min HF top1-top2 gap {min_gap:.1e}"
    )


def test_top5_logprobs_float32(checkpoint: Callable[[str], Path]) -> None:
    """logprobs=5: every returned entry matches HF, and the five are HF's top five."""
    name, k = "hybrid_moe", 5
    model_dir = checkpoint(name)
    prompts = _prompts(name, seed=1)
    outs = _engine_generate(model_dir, "float32", prompts, logprobs=k)
    max_diff, sets_checked = 0.0, 0
    for j, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        ref = hf_teacher_forced_logprobs(model_dir, prompt + out.token_ids, torch.float32)
        rows = ref[len(prompt) - 1 : len(prompt) - 1 + NUM_NEW]
        for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            # Greedy: the sampled token is one of the top k, so there is no extra entry.
            assert tok in lp and len(lp) == k, (j, i, lp)
            for t, v in lp.items():
                diff = abs(v.logprob - rows[i, t].item())
                max_diff = max(max_diff, diff)
                assert diff <= F32_TOL, f"prompt {j} step {i} token {t}: ours {v!r} vs HF {rows[i, t].item()!r}"
            top = rows[i].topk(k + 1)
            # Compare the sets only where HF's k-th and (k+1)-th are clearly apart.
            if top.values[k - 1] - top.values[k] > 10 * F32_TOL:
                sets_checked += 1
                assert set(lp) == set(top.indices[:k].tolist()), (j, i, lp, top)
    assert sets_checked >= len(prompts) * NUM_NEW // 2
    print(
        f"\n[{name}] float32 top-{k}: max |dlogprob| = {max_diff:.2e} over all returned entries, "
        f"top-{k} sets equal at {sets_checked}/{len(prompts) * NUM_NEW} positions"
    )


def test_small_budget_float64(checkpoint: Callable[[str], Path]) -> None:
    """A 20-token step budget and 2 sequence slots: prompts are prefilled in pieces that cut across
    SSD chunks and KV blocks, and the third request waits for a free slot. Still exact."""
    name = "hybrid_moe"
    model_dir = checkpoint(name)
    prompts = _prompts(name, seed=2)
    outs = _engine_generate(model_dir, "float64", prompts, max_num_seqs=2, max_num_batched_tokens=20)
    max_diff, _ = _check_teacher_forced(model_dir, prompts, outs, torch.float64, F64_TOL)
    print(f"\n[{name}] float64, 20-token budget, 2 seqs: max |dlogprob| = {max_diff:.2e}")


# --- Harness self-checks: the reference itself (no engine needed) ----------------------------------


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_reference_is_peaked_and_varied(name: str, checkpoint: Callable[[str], Path]) -> None:
    """The perturbed random models must make greedy parity meaningful (not near-uniform, not stuck)."""
    model_dir = checkpoint(name)
    prompt = _prompts(name)[0]
    greedy = _hf_greedy_cached(name, model_dir, prompt)
    lp = hf_teacher_forced_logprobs(model_dir, prompt + greedy, torch.float32)
    rows = lp[len(prompt) - 1 : len(prompt) - 1 + NUM_NEW]
    assert rows.argmax(-1).tolist() == greedy  # HF generate == its own teacher-forced argmax chain
    assert len(set(greedy)) >= NUM_NEW // 2
    top2 = rows.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median() > 0.1 and gaps.min() > 1e-4
    assert -3.5 < top2[:, 0].median() < -0.2  # peaked, yet far from one-hot
    with torch.no_grad():
        logits = load_hf_model(str(model_dir), torch.float32)(input_ids=torch.tensor([prompt])).logits
    assert torch.isfinite(logits).all() and 2.0 < logits.abs().max() < 30.0


class _DtypeSpy(TorchFunctionMode):
    """Records every torch function that produced a floating tensor of a dtype other than float64."""

    def __init__(self) -> None:
        super().__init__()
        self.non_f64: set[str] = set()

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                self.non_f64.add(f"{getattr(func, '__name__', func)}->{t.dtype}")
        return out


def test_hf_float64_exact(checkpoint: Callable[[str], Path]) -> None:
    """Under the patch HF's forward is float64 throughout, chunking-invariant, and the patch undoes itself."""
    name = "hybrid_moe"  # Mamba n_groups=2, attention, MLP and MoE: every patched cast site
    model = load_hf_model(str(checkpoint(name)), torch.float64)
    ids = torch.tensor([_prompts(name, lens=(69,), seed=3)[0]])
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        spy = _DtypeSpy()
        with hf_float64_exact(), spy:
            exact = model(input_ids=ids, use_cache=False).logits
        assert not spy.non_f64, sorted(spy.non_f64)
        mixers = [layer.mixer for layer in model.model.layers if layer.block_type == "linear_attention"]
        try:
            for m in mixers:
                m.chunk_size = 128  # one SSD chunk instead of nine
            with hf_float64_exact():
                one_chunk = model(input_ids=ids, use_cache=False).logits
        finally:
            for m in mixers:
                m.chunk_size = HF_CONFIGS[name]["chunk_size"]
    assert exact.dtype == torch.float64
    exact, plain, one_chunk = (torch.log_softmax(x, -1) for x in (exact, plain, one_chunk))
    unpatched_gap = (exact - plain).abs().max().item()
    chunk_gap = (exact - one_chunk).abs().max().item()
    print(
        f"\n[{name}] HF float64: |patched - unpatched| = {unpatched_gap:.1e}, |chunk 8 - one chunk| = {chunk_gap:.1e}"
    )
    assert unpatched_gap > 1e-8  # the unpatched forward really is float32 somewhere
    assert chunk_gap < 1e-11

    with pytest.raises(RuntimeError), hf_float64_exact():
        raise RuntimeError
    assert torch.float32 is not torch.float64 and torch.float is torch.float32
    assert torch.ones(1, dtype=torch.float64).float().dtype == torch.float32


def test_checkpoint_layouts(checkpoint: Callable[[str], Path]) -> None:
    """Saved weights use NVIDIA's hub names; tied has no lm_head.weight; legacy has the old config form."""
    tied = checkpoint("tied")
    keys = load_file(tied / "model.safetensors").keys()
    # save_pretrained writes the original layout: backbone.* and one tensor per routed expert.
    assert all(k.startswith("backbone.") for k in keys)
    assert "backbone.layers.4.mixer.experts.3.down_proj.weight" in keys
    model = load_hf_model(str(tied), torch.float32)
    assert torch.equal(model.lm_head.weight, model.model.embeddings.weight)

    legacy = checkpoint("legacy_pattern")
    cfg = (legacy / "config.json").read_text()
    assert '"hybrid_override_pattern": "M-M*-ME"' in cfg and "layers_block_type" not in cfg
    assert load_hf_model(str(legacy), torch.float32).config.layers_block_type[-1] == "moe"


# --- Config edge cases against transformers -------------------------------------------------------

# Max |logprob difference| from transformers over a prompt's last-position top-k. Our bf16 path
# rounds at other points than transformers' (inside the SSD scan first), so the two agree only to a
# few bf16 roundings of logits of size ~5 (observed 0.16 on dense_g1; bf16 vs float32 is 0.24).
LAST_TOL = {"float32": F32_TOL, "bfloat16": 0.3}
TOP_K = 5


def _last_logprobs(model_dir: Path, dtype: str, prompts: list[list[int]]) -> list[dict[int, float]]:
    """Our engine's top-TOP_K logprobs of the token after each prompt (prefill only)."""
    from replayserve import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype, device="cpu", max_num_seqs=len(prompts),
              max_num_batched_tokens=1024, block_size=BLOCK_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP_K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [{t: lp.logprob for t, lp in out.logprobs[0].items()} for out in outs]


def _hf_last(model_dir: Path, dtype: str, prompt: list[int]) -> torch.Tensor:
    return hf_teacher_forced_logprobs(model_dir, prompt, dtype)[-1]


def _max_diff(ours: list[dict[int, float]], ref: list[torch.Tensor]) -> float:
    return max(abs(v - row[t].item()) for lp, row in zip(ours, ref, strict=True) for t, v in lp.items())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_residual_in_fp32_is_not_applied_as_in_transformers(
    dtype: str, checkpoint: Callable[[str], Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers 5.24's NemotronH declares residual_in_fp32 but its blocks never read it (the
    residual stays in the model dtype); so does our engine. A float32 residual would move bf16
    logits here well past bit equality, so the equalities below would catch either side applying it."""
    name = "dense_g1"
    plain = checkpoint(name)
    flagged = tmp_path / "residual_in_fp32"
    shutil.copytree(plain, flagged)
    cfg = json.loads((flagged / "config.json").read_text())
    assert cfg["residual_in_fp32"] is False  # transformers' default, as saved
    (flagged / "config.json").write_text(json.dumps({**cfg, "residual_in_fp32": True}))
    prompts = _prompts(name, lens=(20, 27, 33, 41, 48))

    hf_plain = [_hf_last(plain, dtype, p) for p in prompts]
    assert all(torch.equal(a, _hf_last(flagged, dtype, p)) for a, p in zip(hf_plain, prompts, strict=True))
    if dtype == "bfloat16":
        fp32_residual = [_hf_fp32_residual_last(plain, p) for p in prompts]
        assert max((a - b).abs().max().item() for a, b in zip(hf_plain, fp32_residual, strict=True)) > 1e-2

    ours = _last_logprobs(plain, dtype, prompts)
    with caplog.at_level(logging.WARNING, logger="replayserve.config.model"):
        assert _last_logprobs(flagged, dtype, prompts) == ours
    assert any("residual_in_fp32: true, which is not applied" in r.getMessage() for r in caplog.records)
    diff = _max_diff(ours, hf_plain)
    print(f"\n[{name}] {dtype}: max |dlogprob| vs HF at the last position, top-{TOP_K}: {diff:.2e}")
    assert diff <= LAST_TOL[dtype]


def _hf_fp32_residual_last(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' bf16 forward with the residual stream held in float32, as NVIDIA's remote code
    does for residual_in_fp32: each block adds its bf16 mixer output to a float32 residual."""
    model = load_hf_model(str(model_dir), torch.bfloat16)
    hooks = [layer.register_forward_pre_hook(lambda _m, args: (args[0].float(), *args[1:]))
             for layer in model.model.layers]
    hooks.append(model.lm_head.register_forward_pre_hook(lambda m, args: (args[0].to(m.weight.dtype),)))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, -1]
    finally:
        for hook in hooks:
            hook.remove()
    return torch.log_softmax(logits.to(torch.float64), dim=-1)


def test_tied_config_with_stored_lm_head_uses_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """tie_word_embeddings: true, but the checkpoint stores its own, different lm_head.weight:
    transformers uses the stored matrix, and so do we, with a warning naming the file and the key."""
    model_dir = make_hf_checkpoint(tmp_path / "tied_own_head", "tied", own_lm_head=True)
    stored = load_file(model_dir / "model.safetensors")
    assert json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"] is True
    assert not torch.allclose(stored["lm_head.weight"], stored["backbone.embeddings.weight"])
    assert torch.equal(load_hf_model(str(model_dir), torch.float32).lm_head.weight, stored["lm_head.weight"])

    prompts = _prompts("tied", seed=4)
    with caplog.at_level(logging.WARNING, logger="replayserve.models.loader"):
        outs = _engine_generate(model_dir, "float32", prompts)
    warned = [r.getMessage() for r in caplog.records if r.name == "replayserve.models.loader"]
    assert any(str(model_dir / "model.safetensors") in m and "lm_head.weight" in m for m in warned), warned
    max_diff, _ = _check_teacher_forced(model_dir, prompts, outs, torch.float32, F32_TOL)
    print(f"\n[tied, own lm_head] float32: max |dlogprob| = {max_diff:.2e}")

"""The checkpoint NVIDIA ModelOpt 0.47.0 exported (fixtures/modelopt_fp8) loads and runs on the
CPU (the reference path): FP8 weights stay float8 with their scales, MoE experts included (stacked
with their per-expert scales), the excluded modules are 16-bit, the logits are those of the same
weights dequantized into a float32 model (on the kernels' path too, in the Triton interpreter),
every engine mode generates the same greedy tokens, and a broken scale fails at load naming it.
The greedy agreement with the bf16 model the fixture was made from is printed (run with -s)."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.layers.fp8_linear import FP8Linear
from replayserve.models.loader import CheckpointError, load_model
from replayserve.models.quantization import quantizable_modules
from replayserve.ops.dispatch import force_triton
from replayserve.ops.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8_per_tensor
from replayserve.quantize import _quantization_config

FIXTURE = Path(__file__).parent / "fixtures" / "modelopt_fp8"
VOCAB = 64


@pytest.fixture(autouse=True)
def _quiet_sentinel_warnings() -> None:
    # ModelOpt 0.47's mangled exclude names are logged once per read (models/quantization.py)
    logging.getLogger("replayserve.models.quantization").setLevel(logging.ERROR)


def prompts(count: int, seed: int = 0) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 20, (count,), generator=gen).tolist()
    return [{"prompt_token_ids": torch.randint(3, VOCAB, (n,), generator=gen).tolist()} for n in lens]


def rewritten(tmp: Path, edit: dict[str, torch.Tensor | None], drop_quantization: bool = False) -> Path:
    """A copy of the fixture with tensors replaced (None: removed) as ``edit`` says."""
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    for name, tensor in edit.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    tmp.mkdir()
    save_file(tensors, str(tmp / "model.safetensors"))
    config = json.loads((FIXTURE / "config.json").read_text())
    if drop_quantization:
        config.pop("quantization_config")
    else:
        shutil.copy(FIXTURE / "hf_quant_config.json", tmp)
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def dequantized(tmp: Path) -> Path:
    """The fixture's weights as float32 ``weight * weight_scale``, scales dropped: a plain checkpoint."""
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    edit: dict[str, torch.Tensor | None] = {n: None for n in tensors if n.endswith("_scale")}
    for name, t in tensors.items():
        if t.dtype == FP8_DTYPE:
            edit[name] = dequantize_fp8(t, tensors[name.removesuffix("weight") + "weight_scale"])
    return rewritten(tmp, edit, drop_quantization=True)


def last_logprobs(model_dir: Path, count: int = 8, kernels: bool = False) -> torch.Tensor:
    """(count, VOCAB) log-probabilities of the token after each prompt, float32 on the CPU; with
    `kernels`, every op on its Triton kernel (in the interpreter)."""
    with force_triton() if kernels else contextlib.nullcontext():
        llm = LLM(str(model_dir), dtype="float32", device="cpu", warmup=False)
        outs = llm.generate(prompts(count), SamplingParams(max_tokens=1, temperature=0, logprobs=VOCAB),
                            use_tqdm=False)
    rows = torch.empty(count, VOCAB)
    for i, out in enumerate(outs):
        for token, lp in out.outputs[0].logprobs[0].items():
            rows[i, token] = lp.logprob
    return rows


def test_fp8_weights_stay_float8_with_their_scales_and_the_rest_is_16_bit() -> None:
    stored = load_file(str(FIXTURE / "model.safetensors"))
    model = load_model(FIXTURE, torch.bfloat16, torch.device("cpu"))
    in_proj = model.backbone.layers[0].mixer.in_proj
    assert isinstance(in_proj, FP8Linear) and in_proj.weight.dtype == FP8_DTYPE
    key = "backbone.layers.0.mixer.in_proj."
    assert torch.equal(in_proj.weight.view(torch.uint8), stored[key + "weight"].view(torch.uint8))
    assert torch.equal(in_proj.weight_scale, stored[key + "weight_scale"])
    assert torch.equal(in_proj.input_scale, stored[key + "input_scale"])
    assert not isinstance(model.lm_head, FP8Linear) and model.lm_head.weight.dtype == torch.bfloat16
    assert model.backbone.layers[4].mixer.gate.weight.dtype == torch.float32  # the router: fp32, as in bf16 models
    moe = model.backbone.layers[4].mixer
    w_up, w_down = moe.stacked_experts()
    up_scale, down_scale = moe.expert_scales(len(moe.experts) + 1)
    assert w_up.dtype == w_down.dtype == FP8_DTYPE and moe.num_folded == 1  # the shared expert: the 5th
    for e, key in enumerate([*(f"experts.{e}." for e in range(4)), "shared_experts."]):
        for w, scale, proj in ((w_up, up_scale, "up_proj."), (w_down, down_scale, "down_proj.")):
            name = "backbone.layers.4.mixer." + key + proj
            assert torch.equal(w[e].view(torch.uint8), stored[name + "weight"].view(torch.uint8)), name
            assert torch.equal(scale[e], stored[name + "weight_scale"]), name
    assert isinstance(moe.experts[2].up_proj, FP8Linear) and moe.experts[2].up_proj.input_scale is None
    assert model.backbone.layers[0].mixer.conv1d.weight.dtype == torch.bfloat16


def test_without_activation_scales_the_logits_are_the_dequantized_weights_in_float32(tmp_path: Path) -> None:
    """Same weights, 16-bit activations: equal up to float32 summation order."""
    no_input_scales = {n: None for n in load_file(str(FIXTURE / "model.safetensors")) if n.endswith("input_scale")}
    ours = last_logprobs(rewritten(tmp_path / "fp8", no_input_scales))
    torch.testing.assert_close(ours, last_logprobs(dequantized(tmp_path / "ref")), rtol=1e-4, atol=1e-4)


def test_on_the_kernels_path_the_logits_are_the_dequantized_weights_in_float32(tmp_path: Path) -> None:
    """The same comparison with every op on its Triton kernel: the FP8 GEMV, and the fused MoE
    reading FP8 expert stacks (the shared expert folded in). Without input scales: the interpreter
    rounds activations to FP8 wrongly (ops/fp8_gemv_triton.py)."""
    no_input_scales = {n: None for n in load_file(str(FIXTURE / "model.safetensors")) if n.endswith("input_scale")}
    ours = last_logprobs(rewritten(tmp_path / "fp8", no_input_scales), kernels=True)
    ref = last_logprobs(dequantized(tmp_path / "ref"))
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def with_16_bit(tmp: Path, modules: list[str], input_scales: bool = True) -> Path:
    """The fixture with ``modules`` stored as their dequantized float32 weights, excluded by name
    (and without any input scale unless ``input_scales``)."""
    stored = load_file(str(FIXTURE / "model.safetensors"))
    edit: dict[str, torch.Tensor | None] = {n: None for n in stored if n.endswith("input_scale") and not input_scales}
    for m in modules:
        edit[f"{m}.weight"] = dequantize_fp8(stored[f"{m}.weight"], stored[f"{m}.weight_scale"])
        edit[f"{m}.weight_scale"] = edit[f"{m}.input_scale"] = None
    out = rewritten(tmp, edit)
    quant = json.loads((out / "hf_quant_config.json").read_text())
    quant["quantization"]["exclude_modules"] += modules
    (out / "hf_quant_config.json").write_text(json.dumps(quant))
    return out


def test_a_16_bit_shared_expert_beside_fp8_routed_experts_runs_unfolded(tmp_path: Path) -> None:
    """It cannot join the FP8 stack: not folded, the logits still the dequantized model's."""
    shared = [f"backbone.layers.4.mixer.shared_experts.{p}" for p in ("up_proj", "down_proj")]
    ckpt = with_16_bit(tmp_path / "ckpt", shared, input_scales=False)
    moe = load_model(ckpt, torch.float32, torch.device("cpu")).backbone.layers[4].mixer
    assert moe.num_folded == 0 and not isinstance(moe.shared_experts.up_proj, FP8Linear)
    assert moe.stacked_experts()[0].shape == (4, 16, 32) and moe.expert_scales(4)[0].shape == (4,)
    ours = last_logprobs(ckpt, kernels=True)
    torch.testing.assert_close(ours, last_logprobs(dequantized(tmp_path / "ref")), rtol=1e-4, atol=1e-4)


def test_routed_experts_half_fp8_are_refused_naming_both_kinds(tmp_path: Path) -> None:
    ckpt = with_16_bit(tmp_path / "ckpt", ["backbone.layers.4.mixer.experts.2.down_proj"])
    with pytest.raises(CheckpointError, match=r"quantizes backbone\.layers\.4\.mixer\.experts\.0\.up_proj but not "
                                              r"backbone\.layers\.4\.mixer\.experts\.2\.down_proj"):
        load_model(ckpt, torch.float32, torch.device("cpu"))


def test_with_static_activation_scales_the_logits_stay_near_the_dequantized_model(tmp_path: Path) -> None:
    """The checkpoint's input scales round every quantized Linear's input through FP8 (3 mantissa bits)."""
    ours, ref = last_logprobs(FIXTURE), last_logprobs(dequantized(tmp_path / "ref"))
    gap = (ours - ref).abs().max().item()
    print(f"\nmax |log-prob| gap FP8 (static activation scales) vs dequantized float32: {gap:.4f}")
    assert 0 < gap < 0.25


def test_greedy_agreement_with_the_bf16_source_is_reported() -> None:
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    runs = [LLM(str(d), dtype="float32", device="cpu", warmup=False).generate(prompts(64), params, use_tqdm=False)
            for d in (FIXTURE, FIXTURE / "bf16")]
    pairs = [(a.outputs[0].token_ids, b.outputs[0].token_ids) for a, b in zip(*runs, strict=True)]
    first = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
    tokens = sum(x == y for a, b in pairs for x, y in zip(a, b, strict=True)) / sum(len(a) for a, _ in pairs)
    whole = sum(a == b for a, b in pairs) / len(pairs)
    print(f"\ngreedy agreement FP8 vs bf16 source over 64 prompts x 16 tokens: first token {first:.0%}, "
          f"tokens {tokens:.0%}, whole sequences {whole:.0%}")
    # A 32-wide random model has nearly flat logits; the fixture's FP8 still picks the bf16 model's
    # first token for most prompts (58 of 64 when written)
    assert first >= 0.8


@pytest.mark.parametrize("options", [
    {"ssm_backend": "replay", "replay_window": 4},
    {"enable_prefix_caching": True, "mamba_cache_mode": "all", "mamba_block_size": 8, "block_size": 8},
    {"speculative": {"method": "ngram", "num_speculative_tokens": 3}},
    {"ssm_backend": "replay", "speculative": {"method": "ngram", "num_speculative_tokens": 2}},
], ids=["replay", "prefix-caching", "ngram", "replay-ngram"])
def test_every_engine_mode_generates_the_baselines_tokens(options: dict) -> None:
    """float64 so that the modes' different summation orders cannot flip a greedy token."""
    shared = [1, 7, 9, 11, 13, 7, 9, 11, 13, 7, 9, 11, 13, 7, 9, 11]  # repeats: n-gram proposals; a prefix to hit
    work = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in prompts(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    base = LLM(str(FIXTURE), dtype="float64", device="cpu", warmup=False).generate(work, params, use_tqdm=False)
    llm = LLM(str(FIXTURE), dtype="float64", device="cpu", warmup=False, **options)
    for _ in range(2):  # the second round hits the prefix cache
        got = llm.generate(work, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in base]


@pytest.mark.parametrize(("name", "bad"), [
    ("backbone.layers.3.mixer.out_proj.weight_scale", torch.ones(2)),
    ("backbone.layers.3.mixer.out_proj.weight_scale", None),
    ("backbone.layers.2.mixer.up_proj.input_scale", None),
    ("backbone.layers.1.mixer.v_proj.v_scale", None),
    ("backbone.layers.0.mixer.in_proj.weight_scale", torch.tensor(-1.0)),
    ("backbone.layers.4.mixer.experts.2.up_proj.weight_scale", torch.ones(2)),
    ("backbone.layers.4.mixer.experts.1.down_proj.weight_scale", None),
    ("backbone.layers.4.mixer.shared_experts.down_proj.weight_scale", torch.ones(1, 2)),
    ("backbone.layers.4.mixer.experts.3.up_proj.input_scale", None),
    ("backbone.layers.4.mixer.experts.0.down_proj.weight_scale", torch.tensor(float("nan"))),
], ids=["scale-shape", "missing-weight-scale", "missing-input-scale", "missing-kv-scale", "negative-scale",
        "expert-scale-shape", "missing-expert-scale", "shared-expert-scale-shape", "missing-expert-input-scale",
        "nan-expert-scale"])
def test_a_broken_scale_fails_at_load_naming_the_tensor(tmp_path: Path, name: str, bad: torch.Tensor | None) -> None:
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(rewritten(tmp_path / "ckpt", {name: bad}), torch.float32, torch.device("cpu"))


def test_an_fp8_kv_cache_takes_the_checkpoints_scales_and_every_mode_agrees_on_it() -> None:
    stored = load_file(str(FIXTURE / "model.safetensors"))
    work = prompts(16, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(FIXTURE), dtype="float64", device="cpu", warmup=False, kv_cache_dtype="fp8")
    runner = llm.engine.runner
    assert all(k.dtype == v.dtype == FP8_DTYPE for k, v in runner.kv_caches)
    attention = runner.model.backbone.layers[1].mixer
    assert attention.kv_scales == (stored["backbone.layers.1.mixer.k_proj.k_scale"].item(),
                                   stored["backbone.layers.1.mixer.v_proj.v_scale"].item())
    fp8_kv = [o.outputs[0].token_ids for o in llm.generate(work, params, use_tqdm=False)]
    other = LLM(str(FIXTURE), dtype="float64", device="cpu", warmup=False, kv_cache_dtype="fp8", ssm_backend="replay",
                enable_prefix_caching=True, mamba_cache_mode="all", mamba_block_size=8, block_size=8)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in other.generate(work, params, use_tqdm=False)] == fp8_kv
    exact = LLM(str(FIXTURE), dtype="float64", device="cpu", warmup=False)
    same = sum(a == b for o, fp8 in zip(exact.generate(work, params, use_tqdm=False), fp8_kv, strict=True)
               for a, b in zip(o.outputs[0].token_ids, fp8, strict=True)) / (len(work) * 12)
    print(f"\ngreedy tokens equal with an FP8 KV cache vs a float64 one: {same:.0%}")
    assert same >= 0.6


def test_on_the_kernels_path_an_fp8_kv_cache_gives_the_reference_paths_greedy_tokens(tmp_path: Path) -> None:
    """kv_cache_dtype "fp8" with the checkpoint's k_scale/v_scale, float32: every op on its Triton
    kernel (in the interpreter), the KV write and the varlen attention kernel on FP8 caches, prompts
    in chunks of a 16-token budget (later chunks attend to a cached prefix, decode rows join them);
    the same greedy tokens as the reference path. Eager steps (no CUDA graphs) all take the varlen
    kernel; the decode kernel's entry point is checked in tests/ops/test_attention_fp8_kernels.py.
    Without input scales: the interpreter rounds activations to FP8 wrongly (ops/fp8_gemv_triton.py)."""
    no_input_scales = {n: None for n in load_file(str(FIXTURE / "model.safetensors")) if n.endswith("input_scale")}
    model = rewritten(tmp_path / "fp8", no_input_scales)
    work = prompts(6, seed=9)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = []
    for kernels in (True, False):
        with force_triton() if kernels else contextlib.nullcontext():
            llm = LLM(str(model), dtype="float32", device="cpu", warmup=False, kv_cache_dtype="fp8",
                      max_num_batched_tokens=16)
            assert all(k.dtype == v.dtype == FP8_DTYPE for k, v in llm.engine.runner.kv_caches)
            runs.append([o.outputs[0].token_ids for o in llm.generate(work, params, use_tqdm=False)])
    assert runs[0] == runs[1]


def test_kv_cache_dtype_takes_auto_or_fp8() -> None:
    from replayserve.config import ConfigError

    with pytest.raises(ConfigError, match=r"engine option kv_cache_dtype: 'fp16' is not one of \('auto', 'fp8'\)"):
        LLM(str(FIXTURE), dtype="float32", device="cpu", warmup=False, kv_cache_dtype="fp16")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels' path: CUDA")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_on_cuda_the_kernels_path_follows_the_cpu_reference(kv_cache_dtype: str) -> None:
    """bf16 with CUDA graphs: the FP8 GEMV (decode rows), _scaled_mm or the reference (prefill), the
    FP8 KV cache; greedy tokens against the CPU float32 reference of the same checkpoint."""
    work = prompts(32, seed=7)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = [LLM(str(FIXTURE), dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype).generate(work, params,
                                                                                                 use_tqdm=False)
            for dtype, device in (("bfloat16", "cuda"), ("float32", "cpu"))]
    first = sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(*runs, strict=True))
    print(f"\nCUDA bf16 vs CPU float32, kv_cache_dtype={kv_cache_dtype}: first greedy token equal for {first}/32")
    assert first >= 24


def test_loading_keeps_a_row_scale_where_activations_are_scaled_per_call(tmp_path: Path) -> None:
    """Every FP8 Linear without an input scale, the shared expert included, has its row-wise weight
    scale once loaded; the routed experts (the fused kernel reads their stacked scales) and Linears
    with a static input scale (per-tensor scaling) have none. The experts never apply an input scale."""
    no_input_scales = {n: None for n in load_file(str(FIXTURE / "model.safetensors")) if n.endswith("input_scale")}
    for ckpt, static in ((FIXTURE, True), (rewritten(tmp_path / "fp8", no_input_scales), False)):
        model = load_model(ckpt, torch.bfloat16, torch.device("cpu"))
        routed = {id(m) for m in model.backbone.layers[4].mixer.experts.modules()}
        fp8 = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
        kept = {name for name, m in fp8.items() if m.weight_scale_rows is not None}
        assert kept == {name for name, m in fp8.items() if id(m) not in routed and m.input_scale is None}
        shared = {f"backbone.layers.4.mixer.shared_experts.{p}" for p in ("up_proj", "down_proj")}
        assert shared <= kept and ("backbone.layers.0.mixer.in_proj" in kept) != static  # experts: weight-only
        for name in kept:
            m = fp8[name]
            assert torch.equal(m.weight_scale_rows, m.weight_scale.expand(1, m.out_features)), name


def test_a_granite_fp8_checkpoint_keeps_the_row_scales_of_its_folded_scales(tmp_path: Path) -> None:
    """Granite 4.0-H folds residual_multiplier into its output Linears' weight_scale at load: the
    row-wise scales are made after that, from the folded values."""
    src = make_tiny(tmp_path / "src", family="granite", layers="M*")
    linears, _ = quantizable_modules(load_model(src, torch.float32, torch.device("cpu")))
    chosen = [m for m in linears if not m.endswith("router.layer")]  # the router stays 32-bit

    def stored(module: str) -> str:
        return module if module == "lm_head" else "model." + module.removeprefix("backbone.")

    tensors = load_file(str(src / "model.safetensors"))
    for m in chosen:
        tensors[f"{stored(m)}.weight"], tensors[f"{stored(m)}.weight_scale"] = quantize_fp8_per_tensor(
            tensors[f"{stored(m)}.weight"])
    out = tmp_path / "fp8"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    quant_file, section = _quantization_config([m for m in linears if m not in chosen])
    (out / "hf_quant_config.json").write_text(json.dumps(quant_file))
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": section}))
    shutil.copy(src / "tokenizer.json", out)
    fp8 = {n: m for n, m in load_model(out, torch.float32, torch.device("cpu")).named_modules()
           if isinstance(m, FP8Linear)}
    assert set(fp8) == set(chosen)
    folded = [n for n, m in fp8.items() if not torch.equal(m.weight_scale, tensors[f"{stored(n)}.weight_scale"])]
    assert "backbone.layers.0.mamba.out_proj" in folded
    for name, m in fp8.items():
        assert torch.equal(m.weight_scale_rows, m.weight_scale.expand(1, m.out_features)), name

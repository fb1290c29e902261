"""FP8 (ModelOpt per-tensor) checkpoints under tensor parallelism on the CPU (gloo, float32): each
rank holds the FP8 codes of its 16-bit slice, bit for bit, with every per-tensor scale whole, and 2
ranks give one rank's greedy tokens and its log-probabilities to float32 round-off.

Checkpoints: Nemotron-H quantized by `replayserve quantize` (every Linear but the LM head: Mamba,
attention, MLP, MoE routed and shared experts), with biases on its row-parallel projections
(rank 0's alone) or without; the ModelOpt 0.47 export (static input scales, KV-cache scales, an FP8
KV cache, one Mamba head and one replicated KV head a rank); Qwen3.5-MoE in ModelOpt's layout
(gate and up of each expert requantized to one scale after the cut), and, slow, Qwen3-Next's fused
projections and Granite 4.0-H (stacked gate|up, residual multiplier folded into each rank's scales).
On the CPU FP8 Linears dequantize (activations exact), so nothing but the summation order differs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.config import ModelConfig
from replayserve.layers.fp8_linear import FP8Linear
from replayserve.layers.mlp import MoE
from replayserve.models.loader import load_model
from replayserve.models.quantization import QuantizationError
from replayserve.models.sharding import RankShard
from replayserve.ops.fp8 import FP8_DTYPE
from replayserve.quantize import quantize_checkpoint
from tests.models.test_fp8_checkpoint import FIXTURE
from tests.models.test_qwen_fp8_checkpoint import fp8_checkpoint

TOLERANCE = 1e-4
NUM_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=1, prompt_logprobs=1)
BIASES = {"mlp_bias": True, "use_bias": True}  # MLP / experts' and Mamba's projections
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _quiet_sentinel_warnings() -> None:
    logging.getLogger("replayserve.models.quantization").setLevel(logging.ERROR)


def nemotron_fp8(out: Path, biases: bool) -> Path:
    """A tiny Nemotron-H (Mamba, attention, MLP, MoE) quantized by `replayserve quantize`, every
    Linear in FP8 but the LM head; with `biases`, random ones (make_tiny writes zeros)."""
    src = make_tiny(out / "src", seed=3, layers="M*-ME", **(BIASES if biases else {}))
    if biases:
        tensors = load_file(str(src / "model.safetensors"))
        gen = torch.Generator().manual_seed(5)
        for name in [n for n in tensors if n.endswith("proj.bias")]:
            tensors[name] = torch.randn(tensors[name].shape, generator=gen) * 0.1
        save_file(tensors, str(src / "model.safetensors"))
    quantize_checkpoint(src, out / "fp8", exclude=["lm_head"])
    return out / "fp8"


def granite_fp8(out: Path) -> Path:
    """A tiny Granite 4.0-H in ModelOpt's layout, its routers kept 32-bit."""
    src = make_tiny(out / "src", seed=1, family="granite", layers="M*")
    routers = [n for n, m in load_model(src, torch.float32, CPU).named_modules() if n.endswith("router.layer")]
    return fp8_checkpoint(src, out / "fp8", static=False, keep=tuple(routers))


def _checkpoint(root: Path, name: str) -> Path:
    if name.startswith("nemotron"):
        return nemotron_fp8(root, biases=name.endswith("bias"))
    if name == "modelopt":
        return FIXTURE
    if name == "granite":
        return granite_fp8(root)
    return fp8_checkpoint(make_tiny(root / "src", seed=1, family=name), root / "fp8", static=False)


# (checkpoint, ssm_backend, kv_cache_dtype)
CASES = [
    ("nemotron_bias", "baseline", "auto"),
    ("nemotron", "replay", "auto"),
    ("modelopt", "baseline", "fp8"),
    ("qwen3_5_moe", "replay", "auto"),
    pytest.param(("qwen3_next", "baseline", "auto"), marks=pytest.mark.slow),
    pytest.param(("granite", "replay", "auto"), marks=pytest.mark.slow),
]


def _run(model_dir: Path, ranks: int, backend: str, kv_cache_dtype: str, prompts: list[list[int]]) -> list:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=64, ssm_backend=backend, replay_window=8, tensor_parallel_size=ranks,
              kv_cache_dtype=kv_cache_dtype)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.close()


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list, list]]:
    """(outputs at 1 rank, outputs at 2 ranks) of the case's FP8 checkpoint."""
    name, backend, kv_cache_dtype = request.param
    model_dir = _checkpoint(tmp_path_factory.mktemp(name), name)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 19)]
    yield tuple(_run(model_dir, ranks, backend, kv_cache_dtype, prompts) for ranks in (1, 2))


def test_fp8_tokens_and_logprobs_equal_one_rank(runs: tuple[list, list]) -> None:
    reference, outputs = runs
    pairs = []
    for ref, out in zip(reference, outputs, strict=True):
        assert len(set(ref.outputs[0].token_ids)) > 2, "degenerate continuation: the comparison would be weak"
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(ref.outputs[0].logprobs + ref.prompt_logprobs[1:],
                        out.outputs[0].logprobs + out.prompt_logprobs[1:], strict=True):
            pairs += [(a[t].logprob, b[t].logprob) for t in a]
    worst = max(abs(a - b) for a, b in pairs)
    print(f"max |logprob difference| over {len(pairs)} logprobs: {worst:.3g}")
    assert worst <= TOLERANCE


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def test_each_rank_holds_its_slice_of_the_codes_and_the_whole_scales(tmp_path: Path) -> None:
    """In one process: every FP8 Linear of a rank holds the loader's 16-bit cut of the one-rank
    model's codes bit for bit, the same weight_scale, a row scale of its own width, and a
    row-parallel bias on rank 0 only; each MoE's stacked expert scales are the one-rank model's."""
    model_dir = nemotron_fp8(tmp_path, biases=True)
    cfg = ModelConfig.from_dir(model_dir)
    full = load_model(model_dir, torch.float32, CPU)
    whole = dict(full.named_modules())
    row_parallel_biases = 0
    for rank in range(2):
        shard = RankShard(cfg, rank, 2)
        with torch.device("meta"):
            shard.build(type(full))  # the slicers
        part = load_model(model_dir, torch.float32, CPU, rank=rank, world_size=2)
        fp8 = {n: m for n, m in part.named_modules() if isinstance(m, FP8Linear)}
        assert set(fp8) == {n for n, m in whole.items() if isinstance(m, FP8Linear)}
        for name, m in fp8.items():
            one = whole[name]
            assert torch.equal(_codes(m.weight), _codes(shard.slice(f"{name}.weight", one.weight))), name
            assert torch.equal(m.weight_scale, one.weight_scale), name
            if m.weight_scale_rows is not None:
                assert m.weight_scale_rows.shape == (1, m.weight.shape[0]), name
                assert torch.equal(m.weight_scale_rows, m.weight_scale.expand(1, m.weight.shape[0])), name
            if m.bias is not None and name.endswith(("down_proj", "out_proj")):
                row_parallel_biases += 1
                assert torch.equal(m.bias, one.bias if rank == 0 else torch.zeros_like(one.bias)), name
                assert bool(one.bias.abs().sum() > 0), name
        for name, moe in part.named_modules():
            if isinstance(moe, MoE):
                moe.stacked_experts()
                whole[name].stacked_experts()
                for mine, theirs in zip(moe._scales, whole[name]._scales, strict=True):
                    assert torch.equal(mine, theirs), name
    assert row_parallel_biases >= 6  # Mamba out_proj, MLP down_proj, the shared expert's, on each rank


def test_an_fp8_lm_head_is_refused_under_tensor_parallelism_by_name(tmp_path: Path) -> None:
    """The vocab-parallel head stays 16-bit (as vLLM's): refused at load, with what to do."""
    src = make_tiny(tmp_path / "src", seed=3, layers="M*")
    quantize_checkpoint(src, tmp_path / "fp8", exclude=["backbone.layers.1.*"])
    quant = json.loads((tmp_path / "fp8" / "hf_quant_config.json").read_text())
    assert "lm_head" not in quant["quantization"]["exclude_modules"]
    load_model(tmp_path / "fp8", torch.float32, CPU)  # one rank: an FP8 Linear
    with pytest.raises(QuantizationError, match=r"lm_head\.weight is torch\.float8_e4m3fn.*tensor_parallel_size 1"):
        load_model(tmp_path / "fp8", torch.float32, CPU, rank=1, world_size=2)

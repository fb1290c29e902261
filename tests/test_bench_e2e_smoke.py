"""`benchmarks/bench_e2e.py` end to end on the CPU: the small shape, one batch, a few steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_e2e  # noqa: E402
import e2e_hf  # noqa: E402
import e2e_profile  # noqa: E402


def run_bench(argv: list[str]) -> dict:
    """bench_e2e.main(argv), with torch's thread count put back (the benchmark sets its own)."""
    threads = torch.get_num_threads()
    try:
        return bench_e2e.main(argv)
    finally:
        torch.set_num_threads(threads)


def test_bench_e2e_cpu_smoke(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    try:  # one thread, as the benchmark runs by default: several times faster on a busy machine
        result = bench_e2e.main(["--device", "cpu", "--size", "small", "--batch", "2", "--steps", "2", "--window", "2",
                                 "--warmup", "1", "--repeats", "1", "--prompt-len", "8", "--prefill-prompts", "2",
                                 "--prefill-len", "16", "--ttft-len", "32", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((tmp_path / "bench_e2e.json").read_text())
    assert [(r["backend"], r["batch"]) for r in saved["decode"]] == [("baseline", 2), ("replay", 2)]
    for row in result["decode"]:
        assert row["tok_s"] > 0 and 0 < row["of_roofline"] <= row["of_roofline_bytes"] * 1.0001
        assert "gpu_busy" not in row  # no CUDA: the profiler columns are absent, printed as '-'
        # baseline: 2 x the fp32 state per Mamba layer per row; replay reads it once (+ 1/W writes) plus rings
        assert row["bytes_by_part"]["mamba state"] > 0
    baseline, replay = result["decode"]
    assert replay["bytes_by_part"]["mamba state"] < baseline["bytes_by_part"]["mamba state"]
    assert replay["bytes_by_part"]["replay rings"] > 0 == baseline["bytes_by_part"]["replay rings"]
    assert {r["backend"] for r in result["prefill"]} == {"baseline", "replay"}
    assert all(r["prefill_tok_s"] > 0 and r["ttft_tok_s"] > 0 for r in result["prefill"])


def test_bench_e2e_times_an_fp8_kv_cache_beside_the_models_dtype() -> None:
    result = run_bench(["--device", "cpu", "--size", "small", "--batch", "2", "--steps", "2", "--warmup", "1",
                        "--repeats", "1", "--prompt-len", "8", "--skip-prefill", "--backends", "baseline",
                        "--kv-cache-dtype", "fp8", "auto"])
    assert [r["backend"] for r in result["decode"]] == ["baseline", "baseline+kv8"]
    plain, fp8 = (r["bytes_by_part"]["kv cache"] for r in result["decode"])
    assert fp8 == pytest.approx(plain / 4)  # float32 on the CPU: 4 bytes an entry, 1 in FP8


def test_bench_e2e_async_rows_overlap() -> None:
    result = run_bench(["--device", "cpu", "--size", "small", "--batch", "2", "--steps", "2", "--window", "2",
                        "--warmup", "1", "--repeats", "1", "--prompt-len", "8", "--skip-prefill",
                        "--backends", "baseline-async", "replay-async"])
    assert [r["backend"] for r in result["decode"]] == ["baseline-async", "replay-async"]
    # Every timed step was launched before the previous one was read back.
    assert all(r["tok_s"] > 0 and r["overlapped_share"] == 1 for r in result["decode"])


def test_bench_e2e_refuses_timed_windows_that_cut_a_replay_flush_cycle() -> None:
    """The benchmark's rows flush on the same steps: a timed window shorter than the ReplaySSM window
    could leave the flush steps out and time replay too fast."""
    with pytest.raises(SystemExit, match="multiple of the ReplaySSM window 4"):
        bench_e2e.main(["--device", "cpu", "--size", "small", "--batch", "1", "--steps", "6", "--window", "4",
                        "--warmup", "0", "--repeats", "1", "--prompt-len", "4", "--skip-prefill",
                        "--backends", "replay"])


def test_hf_twin_shares_our_weights_and_its_moe_layer_matches_ours() -> None:
    """transformers' model built by `--hf` on our in-memory weights shares their storage, and its MoE
    layer (transformers stacks the routed experts in memory; our names keep one tensor each) gives
    our layer's output. float32: transformers' grouped expert GEMM takes no float64."""
    from shapes import model_config, random_model

    from replayserve.layers.mlp import MoE

    model = random_model(model_config("tiny"), torch.float32, "cpu", seed=3)
    hf = e2e_hf.hf_twin(model)
    assert hf.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    layer = next(i for i, b in enumerate(model.backbone.layers) if isinstance(b.mixer, MoE))
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf.model.layers[layer].mixer(x[None])[0], model.backbone.layers[layer].mixer(x),
                                   rtol=1e-5, atol=1e-5)


def test_gpu_ms_by_step_splits_a_profile_at_every_layers_first_marker() -> None:
    """Three steps of two layers (mul = the SSM step kernel, add = the rest), profiled on the CPU:
    whole steps are the spans between a step's first marker and the next step's."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            for _ in range(2):
                torch.mul(x, x)
                torch.add(x, x)
    events = sorted((e for e in prof.events() if e.name in ("aten::mul", "aten::add")),
                    key=lambda e: e.time_range.start)
    assert [e.name for e in events] == ["aten::mul", "aten::add"] * 6
    by_step = e2e_profile.gpu_ms_by_step(list(reversed(events)), "aten::mul", per_step=2)
    want = [sum(e.time_range.elapsed_us() for e in events[a:a + 4]) / 1e3 for a in (0, 4)]  # the last step has no end
    assert by_step == want


def test_bench_e2e_times_16_bit_and_fp8_weights_in_one_run() -> None:
    result = run_bench(["--device", "cpu", "--size", "small", "--batch", "2", "--steps", "2", "--window", "2",
                        "--warmup", "1", "--repeats", "1", "--prompt-len", "8", "--prefill-prompts", "2",
                        "--prefill-len", "16", "--ttft-len", "32", "--backends", "baseline",
                        "--quantization", "fp8", "none"])
    assert [r["backend"] for r in result["decode"]] == ["baseline", "baseline+fp8"]
    assert [r["backend"] for r in result["prefill"]] == ["baseline", "baseline+fp8"]
    assert all(r["tok_s"] > 0 for r in result["decode"]) and result["meta"]["fp8_modules"] > 0
    bf16, fp8 = result["decode"]
    # float32 weights -> 1-byte codes for the quantized Linears: fewer weight bytes per step
    assert fp8["bytes_by_part"]["weights"] < bf16["bytes_by_part"]["weights"]
    assert result["meta"]["fp8_weights_gb"] < result["meta"]["weights_gb"]


def test_bench_e2e_fp8_rows_quantize_the_moe_experts() -> None:
    """The tiny shape has a MoE layer: its experts become FP8 too. The weights shrink by 3 bytes
    (float32 on the CPU -> FP8) for every weight of every Linear the recipe keeps, experts included."""
    result = run_bench(["--device", "cpu", "--size", "tiny", "--batch", "1", "--steps", "2", "--window",
                        "2", "--warmup", "1", "--repeats", "1", "--prompt-len", "8", "--skip-prefill",
                        "--backends", "baseline", "--quantization", "none", "fp8"])
    cfg = bench_e2e.model_config("tiny")
    rule = bench_e2e.QuantConfig("FP8", None, bench_e2e.default_excludes(cfg), "test")
    linears = {n: m for n, m in bench_e2e.NemotronHForCausalLM(cfg).named_modules()
               if isinstance(m, torch.nn.Linear) and not rule.is_excluded(n)}
    experts = [n for n in linears if "experts." in n]
    meta = result["meta"]
    assert meta["fp8_expert_modules"] == len(experts) > 0
    saved = 3 * sum(m.weight.numel() for m in linears.values()) / 1e9
    assert meta["weights_gb"] - meta["fp8_weights_gb"] == pytest.approx(saved, rel=1e-9)
    bf16, fp8 = (r["bytes_by_part"]["weights"] for r in result["decode"])
    assert fp8 < bf16


def test_bench_e2e_runs_a_gated_deltanet_shape_on_both_backends(tmp_path: Path) -> None:
    """A Qwen3.5 shape end to end on both GDN backends: ReplaySSM reads and writes fewer state bytes
    and adds its rings."""
    result = run_bench(["--device", "cpu", "--size", "qwen3.5-small", "--batch", "2", "--steps", "2",
                        "--window", "2", "--warmup", "1", "--repeats", "1", "--prompt-len", "8",
                        "--prefill-prompts", "2", "--prefill-len", "16", "--ttft-len", "32"])
    baseline, replay = result["decode"]
    assert (baseline["backend"], replay["backend"]) == ("baseline", "replay")
    assert baseline["tok_s"] > 0 and baseline["bytes_by_part"]["mamba state"] == 0
    # 2 rows x 6 GDN layers x (state read + written) of (Hv, K, V) = (4, 32, 32) fp32, plus the conv state
    gdn = 2 * 6 * (2 * 4 * 32 * 32 * 4 + 2 * (2 * 2 * 32 + 4 * 32) * 3 * 4)
    assert baseline["bytes_by_part"]["gdn state"] == gdn
    assert not replay.get("skipped") and replay["tok_s"] > 0
    assert replay["bytes_by_part"]["gdn state"] < gdn and replay["bytes_by_part"]["replay rings"] > 0
    assert result["prefill"][0]["prefill_tok_s"] > 0 and result["prefill"][0]["ttft_tok_s"] > 0

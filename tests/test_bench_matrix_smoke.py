"""`benchmarks/bench_matrix.py` end to end on the CPU: the tiny shape, two prompts, a few tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_matrix  # noqa: E402


def test_bench_matrix_cpu_smoke(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "matrix.json"
    try:
        result = bench_matrix.main(["--device", "cpu", "--size", "tiny", "--batch", "2", "--prompt-len", "24",
                                    "--max-tokens", "12", "--modes", "off", "align", "--acceptance", "1.0", "0.0",
                                    "--k", "2", "--window", "4", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    rows = result["rows"]
    saved = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["mode"], r["spec"], r["acceptance"], r["wave"]) for r in saved] == [
        (b, m, s, a, w) for s, accs in (("none", [None]), ("mtp", [1.0, 0.0])) for b in ("baseline", "replay")
        for m in ("off", "align") for a in accs for w in (1, 2)]
    assert all("skipped" not in r for r in rows)
    # Lossless on every row; unique prompts never hit the cache.
    assert all(r["same"] == 1.0 and r["prefix_cache_hits"] == 0 for r in rows)
    assert all(r["e2e_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["generated"] == 2 * 12 for r in rows)
    for r in rows:
        if r["spec"] == "none":
            assert r["spec_num_draft_tokens"] == 0 and r["tokens_per_row_step"] == 1
            continue
        # The set acceptance is what the engine measures: every draft kept at 1.0, none at 0.0.
        assert r["spec_num_draft_tokens"] > 0
        assert r["spec_num_accepted_tokens"] == (r["spec_num_draft_tokens"] if r["acceptance"] == 1.0 else 0)
        assert r["acceptance_per_draft"] == r["acceptance"]
        assert r["tokens_per_row_step"] > 2.5 if r["acceptance"] == 1.0 else r["tokens_per_row_step"] == 1
        # The MTP layers ran every verify step, and their floor is counted.
        # (the ops floor charges each part at least its bytes: equal up to the order of the sums)
        assert r["mtp_ms_per_step"] > 0 and 0 < r["mtp_floor_bytes_ms"] <= r["mtp_floor_ops_ms"] * (1 + 1e-9)
        assert 1 <= r["mtp_rows_per_step"] <= 2


def test_bench_matrix_mtp_rows_alone_follow_an_unreported_reference() -> None:
    threads = torch.get_num_threads()
    try:
        result = bench_matrix.main(["--device", "cpu", "--size", "tiny", "--batch", "2", "--prompt-len", "16",
                                    "--max-tokens", "24", "--modes", "none", "--backends", "replay", "--spec", "mtp",
                                    "--acceptance", "0.5", "--k", "3", "--window", "4"])
    finally:
        torch.set_num_threads(threads)
    rows = result["rows"]
    assert [(r["backend"], r["mode"], r["spec"], r["wave"]) for r in rows] == [("replay", "none", "mtp", 1),
                                                                               ("replay", "none", "mtp", 2)]
    assert all(r["same"] == 1.0 and 0 < r["spec_num_accepted_tokens"] < r["spec_num_draft_tokens"] for r in rows)
    assert all(0 < r["acceptance_per_draft"] < 1 for r in rows)


def test_mtp_floor_counts_the_mtp_weights_and_lm_head_once_per_draft() -> None:
    """A dense MTP step (attention + MLP) of float32 weights: every weight byte once per draft; the
    keys and values of each window position read by every draft, the drafts' own and the new
    positions' written; with the MTP cache, the hidden states and projections of the new
    positions alone."""
    import dataclasses

    from roofline import mtp_ops
    from shapes import model_config, random_model

    cfg = dataclasses.replace(model_config("tiny"), num_nextn_predict_layers=1,
                              mtp_layer_types=("full_attention", "mlp"))
    model = random_model(cfg, torch.float32, "cpu")
    ops = {op.name: op for op in mtp_ops(model, rows=2, drafts=3, window_lens=[10.0, 4.0])}
    mtp_bytes = 4 * sum(p.numel() for p in model.mtp.parameters())
    assert ops["mtp weights"].bytes == 3 * mtp_bytes
    assert ops["lm head"].bytes == 3 * 4 * cfg.vocab_size * cfg.hidden_size
    kv_per_position = 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    # draft j (1..3) attends over the window and the j drafts' positions so far: 3 * n + (1 + 2 + 3)
    assert ops["mtp kv and hidden"].bytes == kv_per_position * (3 * 14 + 2 * 6 + 14) + 14 * cfg.hidden_size * 4
    matrices = sum(p.numel() for p in model.mtp.parameters() if p.dim() == 2)
    assert ops["mtp weights"].flops == 2 * (14 + 2 * 2) * matrices  # the windows, then one position per row
    cached = {op.name: op for op in mtp_ops(model, rows=2, drafts=3, window_lens=[10.0, 4.0], new_lens=[3.0, 1.0])}
    assert cached["mtp weights"].bytes == 3 * mtp_bytes
    assert cached["mtp kv and hidden"].bytes == kv_per_position * (3 * 14 + 2 * 6 + 4) + 4 * cfg.hidden_size * 4
    assert cached["mtp weights"].flops == 2 * (4 + 2 * 2) * matrices

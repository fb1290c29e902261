"""`NemotronHMTP.forward(..., last_only=True)` (what the MTP proposer runs) is the last row of the
full forward, for stacks with attention first, last, or none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve.builtin.tiny import make_tiny
from replayserve.models.loader import load_model


@pytest.mark.parametrize("mtp_layers", [("full_attention", "moe"), ("mlp", "full_attention"), ("moe", "mlp")])
def test_last_row_equals_the_full_forwards(tmp_path: Path, mtp_layers: tuple[str, ...]) -> None:
    make_tiny(tmp_path, seed=3, layers="M*", num_nextn_predict_layers=1, mtp_layer_types=mtp_layers)
    model = load_model(tmp_path, torch.float64, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(23, model.config.hidden_size, generator=gen, dtype=torch.float64)
    hidden = torch.randn(23, model.config.hidden_size, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        full = model.mtp(embeds, hidden)
        last = model.mtp(embeds, hidden, last_only=True)
    assert last.shape == (1, model.config.hidden_size)
    torch.testing.assert_close(last, full[-1:], rtol=0, atol=1e-12)

"""Writes the ModelOpt FP8 test fixture: a tiny random Nemotron-H built in transformers, quantized
with NVIDIA ModelOpt's own FP8 recipe (weights and static activation scales, plus an FP8 KV cache)
on the CPU, and exported with ModelOpt's Hugging Face exporter. Beside the export it saves the
bf16 model it started from (``bf16/``), so tests can check our quantizer against ModelOpt's.
The MoE layer's experts come out FP8 like every other projection: each expert's ``up_proj`` and
``down_proj`` with its own ``weight_scale`` (the experts of a layer share one ``input_scale``),
which the loader keeps FP8 for the fused MoE kernel (``tests/models/test_fp8_checkpoint.py``).

ModelOpt runs here in a virtual environment of its own, so it cannot change the project's
(it wants ``transformers<5.15`` for its ``hf`` extra; the plain package takes any transformers):

    python -m venv /work/venv-modelopt            # fresh: no --system-site-packages
    /work/venv-modelopt/bin/pip install torch==2.13.0   # the CPU wheel first, so nothing pulls a CUDA torch
    /work/venv-modelopt/bin/pip install nvidia-modelopt==0.47.0 transformers==5.24.0 requests
    /work/venv-modelopt/bin/python scripts/make_modelopt_fp8_fixture.py tests/models/fixtures/modelopt_fp8

(ModelOpt 0.47.0 imports ``requests`` without declaring it.) Everything runs on the CPU:
``mtq.quantize`` calibrates with max calibration over a few random batches (transformers' reference
Mamba and attention paths), and ``export_hf_checkpoint`` writes the checkpoint. Two things the tool
needs from the model: ``config.architectures`` set (its multimodal check iterates it), and, to match
what it writes for Nemotron-H, nothing else. Its exclude list comes out mangled in 0.47.0 (each
entry ends in ``.\\x00backbone.pt_name_sentinel``); the fixture keeps the export as written, and
``replayserve/models/quantization.py`` reads such entries (see its comment for the cause).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import modelopt.torch.quantization as mtq  # noqa: E402
import torch  # noqa: E402
from modelopt.torch.export import export_hf_checkpoint  # noqa: E402
from transformers import NemotronHConfig, NemotronHForCausalLM  # noqa: E402

# Mamba, attention, MLP, Mamba, MoE: every kind of layer, small enough to commit.
LAYERS = ["linear_attention", "full_attention", "mlp", "linear_attention", "moe"]
SIZES = {
    "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "intermediate_size": 64, "mamba_num_heads": 2, "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 1,
    "conv_kernel": 4, "expand": 1, "chunk_size": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16,
    "max_position_embeddings": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


def fp8_recipe(kv_cache: bool) -> dict:
    """ModelOpt's FP8 preset (per-tensor e4m3 weights and inputs, max calibration, its default
    exclusions), with its FP8 KV-cache preset appended when ``kv_cache``."""
    recipe = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    if kv_cache:
        recipe["quant_cfg"] = [*recipe["quant_cfg"], *copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])]
    return recipe


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-kv-cache", action="store_true", help="leave the KV cache unquantized")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    config = NemotronHConfig(**SIZES, layers_block_type=LAYERS, architectures=["NemotronHForCausalLM"])
    model = NemotronHForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(args.out_dir / "bf16")

    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randint(3, SIZES["vocab_size"], (2, 16), generator=gen) for _ in range(4)]

    def calibrate(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for ids in batches:
                m(ids)

    model = mtq.quantize(model, fp8_recipe(kv_cache=not args.no_kv_cache), calibrate)
    # The dtype is named: save_pretrained above left config.torch_dtype a string, which the exporter would take.
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=args.out_dir)
    quant = json.loads((args.out_dir / "hf_quant_config.json").read_text())
    print(f"wrote {args.out_dir}: {json.dumps(quant['quantization'])}")


if __name__ == "__main__":
    main()

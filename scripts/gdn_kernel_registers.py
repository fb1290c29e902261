"""Registers, spills and shared memory of the Gated DeltaNet decode kernels, built for sm_90 without a GPU.

Triton compiles ahead of time to a cubin for a named target, and the cuobjdump that ships with it
reads the resources back, so the numbers quoted in docs/replayssm.md (section Gated DeltaNet,
Kernels) are checked on any machine: the ReplaySSM read kernel (T = 1 and T = 4), its flush and
materialization kernels, and the baseline step, at the Qwen3.5 shape (K = V = 128, R = 32, bf16
activations, fp32 state) and the launch options the entry points use.

    python scripts/gdn_kernel_registers.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replayserve.ops import gated_delta_triton, replay_gdn_decode_triton, replay_gdn_triton  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
POOL = {"state_ptr": "*fp32", "k_ring_ptr": "*bf16", "d_ring_ptr": "*fp32", "g_ring_ptr": "*fp32",
        "ring_start_ptr": "*i32", "history_ptr": "*i32", "is_flush_ptr": "*i1", "slots_ptr": "*i64",
        "ntok_ptr": "*i32", "src_ptr": "*i64", "dst_ptr": "*i64", "start_ptr": "*i32", "n_ptr": "*i32",
        "idx_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32",
        "beta_ptr": "*fp32", "o_ptr": "*bf16", "out_ptr": "*fp32", "coef_ptr": "*fp32", "scale": "fp32"}


def resources(kernel: triton.JITFunction, constexprs: dict, num_warps: int) -> str:
    """cuobjdump's resource line (REG, STACK, SHARED, ...) of `kernel` built for sm_90; other
    arguments are pointers of the dtypes in POOL or int32."""
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else POOL.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        Path(path).write_bytes(compiled.asm["cubin"])
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", path], capture_output=True, text=True,
                             check=True).stdout
    return next(line.strip() for line in out.splitlines() if "REG:" in line)


def main() -> None:
    tile = {"L2NORM": True, "BLOCK_E": 32, "BLOCK_K": 128, "BLOCK_V": 32, "PRECISION": replay_gdn_triton.PRECISION}
    read = dict(tile, BLOCK_T=1, BLOCK_C=128, DOT=False)
    cases = [
        ("replay read, T = 1, fused (4 warps)", replay_gdn_triton._replay_gdn_read_kernel, read, 4),
        ("replay decode coefficients (4 warps)", replay_gdn_decode_triton._replay_gdn_coef_kernel,
         {"L2NORM": True, "BLOCK_E": 32, "BLOCK_K": 128}, 4),
        ("replay decode tile (4 warps)", replay_gdn_decode_triton._replay_gdn_tile_kernel,
         {"K_RING_DTYPE": replay_gdn_decode_triton._TL_DTYPES[torch.bfloat16], "BLOCK_E": 32, "BLOCK_K": 128,
          "BLOCK_V": 32}, 4),
        ("replay read, T = 4 (8 warps)", replay_gdn_triton._replay_gdn_read_kernel,
         dict(read, BLOCK_T=16, BLOCK_C=32, DOT=True), 8),
        ("replay flush (4 warps)", replay_gdn_triton._replay_gdn_flush_kernel, dict(tile, BLOCK_ROWS=256), 4),
        ("replay materialize (8 warps)", replay_gdn_triton._replay_gdn_materialize_kernel, tile, 8),
        ("baseline step (4 warps)", gated_delta_triton._gated_delta_kernel,
         {"HAS_INDICES": True, "L2NORM": True, "WRITE_POOL": True, "KEEP_STATES": False, "BLOCK_K": 128,
          "BLOCK_V": 32}, 4),
    ]
    print(f"Triton {triton.__version__}, sm_90, K = V = 128, E = 32, BLOCK_V = 32")
    for label, kernel, constexprs, warps in cases:
        print(f"{label}: {resources(kernel, constexprs, warps)}")


if __name__ == "__main__":
    main()

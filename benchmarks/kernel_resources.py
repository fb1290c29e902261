"""Registers, stack and shared memory of the ReplaySSM step kernels for sm_90, with no GPU.

Each wrapper's launches are captured (arguments and constexprs as a real launch specializes them:
ints equal to 1 become constants, multiples of 16 and tensors get divisibility hints), compiled by
Triton's bundled ptxas and read back with its cuobjdump. Use the Triton version of the target
machine (3.6 on the H200 image) for counts that match it: e.g. a venv with `pip install
triton==3.6.0`, then

    PYTHONPATH=$PWD python benchmarks/kernel_resources.py [module] [BLOCK_P/warps[/maxnreg] ...]

(``REPLAY_WINDOW=32`` for the window of plain decode; 16 by default).

Registers bound this memory-bound kernel: they set the programs, hence loads, in flight per SM.
"""
import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
TY = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8",
      torch.bool: "*u8"}


class Capture:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **k: self.calls.append((a, k))


def compile_call(fn, args, kwargs):  # noqa: ANN001, ANN201 - a dev tool over Triton internals
    """Compiles one captured launch for sm_90; returns cuobjdump's resource line."""
    options = {"num_warps": kwargs.pop("num_warps", 4)}
    if "maxnreg" in kwargs:  # a register cap, as the launch option of the same name
        options["maxnreg"] = kwargs.pop("maxnreg")
    sig, consts, attrs = {}, dict(kwargs), {}
    for i, (name, v) in enumerate(zip(fn.arg_names, args, strict=False)):
        if isinstance(v, torch.Tensor):
            sig[name] = TY[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif v is None:
            sig[name] = "constexpr"
            consts[name] = None
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif isinstance(v, int):
            if v == 1:
                sig[name] = "constexpr"
                consts[name] = 1
            else:
                sig[name] = "i32" if abs(v) < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
    for name in kwargs:
        sig[name] = "constexpr"
    src = triton.compiler.ASTSource(fn, sig, consts, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = [ln for ln in out.splitlines() if "REG" in ln]
    return line[0].strip().split("CONSTANT")[0] if line else out


def step_args(mod, T, H=128, P=64, N=128, G=8, W=None, S=8):
    W = W or int(os.environ.get("REPLAY_WINDOW", 16))
    R = W + T
    st = torch.zeros(S, H, P, N)
    xr, dr = torch.zeros(S, H, R, P, dtype=torch.bfloat16), torch.zeros(S, H, R)
    br = torch.zeros(S, G, R, N, dtype=torch.bfloat16)
    cur = [torch.zeros(S, dtype=torch.int32), torch.zeros(S, dtype=torch.int32), torch.zeros(S, dtype=torch.bool)]
    rows = 4
    x, dt = torch.zeros(rows, T, H, P, dtype=torch.bfloat16), torch.zeros(rows, T, H, dtype=torch.bfloat16)
    B, C = torch.zeros(rows, T, G, N, dtype=torch.bfloat16), torch.zeros(rows, T, G, N, dtype=torch.bfloat16)
    vec = torch.zeros(H)
    return (st, xr, dr, br, *cur, torch.zeros(rows, dtype=torch.int64), torch.ones(rows, dtype=torch.int32),
            x, dt, vec, B, C, vec, vec)


def main():
    mod = importlib.import_module(sys.argv[1] if len(sys.argv) > 1 else "replayserve.ops.replay_ssm_triton")
    default = mod._step_config
    # BLOCK_P/num_warps[/maxnreg] launch configs; none given: the module's own
    configs = [dict(zip(("BLOCK_P", "num_warps", "maxnreg"), map(int, c.split("/")), strict=False))
               for c in sys.argv[2:]] or [None]
    # The step's kernels, and the flush kernel that its T = 1 steps launch from their own module.
    homes = [mod, importlib.import_module("replayserve.ops.replay_flush_triton")]
    names = [(home, n) for home in homes for n in dir(home) if n.startswith("_replay_") and n.endswith("_kernel")]
    for T in (1, 4):
        for config in configs:
            mod._step_config = default if config is None else (lambda *_, c=config: dict(c))
            caps = {n: Capture() for _, n in names}
            saved = {n: getattr(home, n) for home, n in names}
            for home, n in names:
                setattr(home, n, caps[n])
            try:
                mod.replay_step_triton(*step_args(mod, T))
            finally:
                for home, n in names:
                    setattr(home, n, saved[n])
            for n, c in caps.items():
                for a, k in c.calls:
                    label = "/".join(str(k[o]) for o in ("BLOCK_P", "num_warps", "maxnreg") if o in k)
                    print(f"T={T} {label} {n}: {compile_call(saved[n], a, dict(k))}", flush=True)
    mod._step_config = default


if __name__ == "__main__":
    main()


"""The package as a user installs it: importable and runnable on the CPU where Triton is absent,
and ``python -m replayserve`` is the ``replayserve`` command.

Triton ships wheels for Linux x86-64 / aarch64 only; elsewhere (macOS, Windows) the CPU path must
not need it. The child processes below make ``import triton`` fail the way a missing package does,
then drive the engine through every CPU feature that sits next to a Triton kernel on CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from replayserve import LLM, SamplingParams

# Makes `import triton` (and `triton.*`) fail exactly as an absent package does, before anything
# else is imported.
_HIDE_TRITON = """
import importlib.abc, sys
class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoTriton())
sys.modules.pop("triton", None)
"""

_CONFIGS = {
    "baseline": {},
    "replay": {"ssm_backend": "replay"},
    "prefix-all": {"enable_prefix_caching": True, "mamba_cache_mode": "all", "ssm_backend": "replay"},
    "ngram": {"speculative": {"method": "ngram", "num_speculative_tokens": 2}},
    "async": {"async_scheduling": True},
}
_PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 1]]


def _run_hidden(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env_code = _HIDE_TRITON + code
    return subprocess.run([sys.executable, "-c", env_code], capture_output=True, text=True, timeout=600, cwd=cwd)


def _greedy_tokens(model_dir: str) -> dict[str, list[list[int]]]:
    out = {}
    for name, options in _CONFIGS.items():
        llm = LLM(model=model_dir, dtype="float32", device="cpu", max_num_seqs=4, **options)
        results = llm.generate([{"prompt_token_ids": p} for p in _PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        out[name] = [r.outputs[0].token_ids for r in results]
    return out


def test_cpu_path_runs_without_triton(tiny_model_dir: Path) -> None:
    code = f"""
import json, sys
import replayserve
from tests.test_packaging import _greedy_tokens
tokens = _greedy_tokens({str(tiny_model_dir)!r})
loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
print(json.dumps({{"tokens": tokens, "triton_modules": loaded}}))
"""
    done = _run_hidden(code, Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["triton_modules"] == []
    # The same tokens as with Triton importable (the CPU path never runs a kernel either way).
    assert result["tokens"] == _greedy_tokens(str(tiny_model_dir))


def test_command_line_runs_without_triton(tmp_path: Path) -> None:
    code = """
import sys
sys.argv = ["replayserve", "--version"]
import runpy
runpy.run_module("replayserve", run_name="__main__")
"""
    done = _run_hidden(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith("replayserve ")


@pytest.mark.parametrize("args", [["--version"], ["make-tiny", "--help"]])
def test_python_dash_m_is_the_command(args: list[str]) -> None:
    module = subprocess.run([sys.executable, "-m", "replayserve", *args], capture_output=True, text=True, timeout=120)
    script = subprocess.run([sys.executable, "-c", "from replayserve.cli import main; main()", *args],
                            capture_output=True, text=True, timeout=120)
    assert module.returncode == 0, module.stderr
    assert module.stdout == script.stdout and module.stdout.strip()

"""replayserve: a serving engine for hybrid Mamba2/attention language models."""

from importlib.metadata import PackageNotFoundError, version

from replayserve.llm import LLM
from replayserve.outputs import CompletionOutput, Logprob, RequestOutput
from replayserve.sampling_params import SamplingParams

try:
    __version__ = version("replayserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]

"""replayserve: a serving engine for hybrid Mamba2/attention language models."""

from replayserve.engine.request import SamplingParams
from replayserve.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

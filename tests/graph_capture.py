"""Capturing a callable in a CUDA graph for the kernels' graph-replay tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(fn: Callable[[torch.Tensor], torch.Tensor], static_x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph,
                                                                                         torch.Tensor]:
    """(graph, its output tensor) of ``fn(static_x)``: one eager call on a side stream first, so
    Triton compiles outside the capture; replaying the graph rewrites the output from ``static_x``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(static_x)
    return graph, static_out

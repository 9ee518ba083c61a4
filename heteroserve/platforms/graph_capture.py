"""How a device records a stretch of kernels once and replays it: CUDA graphs, and the vendors' twins of them.

A device whose kernel launches cost more than a small decode step computes (CUDA graphs; Ascend's ACL graphs
through torch_npu's `NPUGraph`) returns its API from `Platform.graph_capture`; the model runner
(worker/decode_graphs.py) then records a decode step's forward once per batch size and replays it with the next
step's inputs copied into the recorded buffers. The CPU has none: its steps run as they come.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Graph(Protocol):
    """A recorded stretch of device work (torch.cuda.CUDAGraph's interface)."""

    def replay(self) -> None: ...


class GraphCapture:
    """A device's graph API in torch.cuda's shape: `new_graph()` makes an empty graph, `recording(graph, pool=...)`
    is the context within which the device's work is recorded into it instead of run, and `new_pool()` gives the
    memory pool the graphs of one model runner share (they replay one at a time)."""

    def __init__(
        self,
        name: str,
        new_graph: Callable[[], Graph],
        recording: Callable[..., AbstractContextManager[Any]],
        new_pool: Callable[[], Any],
    ) -> None:
        self.name = name  # what the start-up log and `heteroserve env` call it: "CUDA graphs"
        self.new_graph = new_graph
        self.recording = recording
        self.new_pool = new_pool

    def record(self, forward: Callable[[], T], pool: Any) -> tuple[Graph, T]:
        """Records `forward()` into a new graph drawing its memory from `pool`; its result's tensors are the
        buffers each replay writes again."""
        graph = self.new_graph()
        with self.recording(graph, pool=pool):
            output = forward()
        return graph, output

"""Decode steps replayed from recorded graphs, on devices that have them (Platform.graph_capture).

A decode-only step of R rows runs as the graph recorded for the smallest size S >= R (`capture_sizes`) and the
smallest block-table width W (a power of two) that holds its longest table. The step's token ids, positions and
attention metadata are copied into that graph's buffers: its R rows, then S - R padding rows, one-token requests at
position 0 whose keys and values go to a block of each KV group that the block pool never hands out. The graph
replays and its first R rows are the step's hidden states. Each (S, W) is recorded the first time a step needs it,
after one eager run of the same inputs (kernels set up their handles outside the recording).

What the graphs do not cover runs eagerly, as on a device without graphs: steps with prefill rows, LoRA adapters
or images, and more rows than the largest size. The attention backend's metadata must keep its shapes for a given
(S, W); one that does not turns the graphs off with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from heteroserve.platforms.graph_capture import Graph, GraphCapture

logger = logging.getLogger(__name__)

# One request's part of a step as the attention metadata takes it: (block ids, first new position, new tokens).
StepRequest = tuple[list[int], int, int]
# Builds a window's attention metadata for requests, the first `num_decodes` of them decodes.
MetadataBuilder = Callable[[int | None, list[StepRequest], int], Any]


def capture_sizes(max_rows: int) -> list[int]:
    """Row counts graphs are recorded for: 1, 2, 4, 8, every 8 up to 64, then every 32, up to `max_rows` (which is
    always one), so a step pads to at most the next size."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(96, max_rows, 32)]
    return sorted({s for s in sizes if s < max_rows} | {max_rows})


def copy_into(recorded: Any, new: Any) -> None:
    """Copies a step's metadata into the recorded graph's: tensors in place, everything else must already agree.
    ValueError where the structure or a shape differs."""
    if isinstance(recorded, torch.Tensor):
        if recorded.shape != new.shape or recorded.dtype != new.dtype:
            raise ValueError(f"a metadata tensor is {tuple(new.shape)} {new.dtype}, recorded {tuple(recorded.shape)}")
        recorded.copy_(new)
    elif dataclasses.is_dataclass(recorded):
        for f in dataclasses.fields(recorded):
            copy_into(getattr(recorded, f.name), getattr(new, f.name))
    elif isinstance(recorded, list | tuple):
        if len(recorded) != len(new):
            raise ValueError(f"a metadata list holds {len(new)} entries, recorded {len(recorded)}")
        for r, n in zip(recorded, new, strict=True):
            copy_into(r, n)
    elif isinstance(recorded, dict):
        if recorded.keys() != new.keys():
            raise ValueError(f"metadata keys {sorted(map(str, new))}, recorded {sorted(map(str, recorded))}")
        for key, value in recorded.items():
            copy_into(value, new[key])
    elif recorded != new:
        raise ValueError(f"a metadata value is {new!r}, recorded {recorded!r}")


@dataclass
class RecordedStep:
    graph: Graph
    token_ids: torch.Tensor  # [S] the graph's inputs, written before each replay
    positions: torch.Tensor  # [S]
    metadata: dict[int | None, Any]  # per window, as the backend built it for the recording
    hidden: torch.Tensor  # [S, hidden] what each replay writes


class DecodeGraphs:
    def __init__(
        self,
        capture: GraphCapture,
        forward: Callable[[torch.Tensor, torch.Tensor, dict[int | None, Any]], torch.Tensor],
        build_metadata: MetadataBuilder,
        windows: list[int | None],
        pad_blocks: list[int],
        max_rows: int,
        device: torch.device,
    ) -> None:
        """forward(token_ids, positions, metadata by window) -> hidden states: the model over its KV cache.
        windows: each KV group's window that this rank holds layers of; pad_blocks: per such group, the block that
        padding rows write to (outside the block pool)."""
        self.capture = capture
        self.forward = forward
        self.build_metadata = build_metadata
        self.windows = windows
        self.pad_blocks = pad_blocks
        self.sizes = capture_sizes(max_rows)
        self.device = device
        self.pool = capture.new_pool()
        self.recorded: dict[tuple[int, int], RecordedStep] = {}
        self.enabled = True
        self.replayed = 0  # steps that ran as a replay

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def run(self, requests: list[list[StepRequest]], token_ids: list[int], positions: list[int]) -> torch.Tensor | None:
        """The hidden states of a decode-only step (`requests`: per group in `windows`, every request's part of
        the step), or None where the graphs do not cover it and the caller runs it eagerly."""
        rows = len(token_ids)
        if not self.enabled or rows > self.max_rows:
            return None
        size = next(s for s in self.sizes if s >= rows)
        longest = max(len(block_ids) for group in requests for block_ids, _, _ in group)
        width = 1 << max(longest - 1, 0).bit_length()
        try:
            step = self.recorded.get((size, width)) or self._record(size, width)
            copy_into(step.metadata, self._metadata(requests, size - rows, width))
        except Exception as exc:  # noqa: BLE001 - any failure to record or refill means: run eagerly from now on
            self.enabled = False
            logger.warning(
                "%s off: a decode step of %d rows (table width %d) could not run as one (%s: %s); decode steps run "
                "eagerly from now on",
                self.capture.name,
                size,
                width,
                type(exc).__name__,
                exc,
            )
            return None
        pad = size - rows
        step.token_ids.copy_(torch.tensor(token_ids + [0] * pad, dtype=torch.long))
        step.positions.copy_(torch.tensor(positions + [0] * pad, dtype=torch.long))
        step.graph.replay()
        self.replayed += 1
        return step.hidden[:rows]

    def _metadata(self, requests: list[list[StepRequest]], pad: int, width: int) -> dict[int | None, Any]:
        """Per window, the metadata of the step's requests and `pad` padding requests, every table `width` long."""
        meta = {}
        for window, group, pad_block in zip(self.windows, requests, self.pad_blocks, strict=True):
            tables = [(ids + [pad_block] * (width - len(ids)), start, n) for ids, start, n in group]
            tables += [([pad_block] * width, 0, 1)] * pad
            meta[window] = self.build_metadata(window, tables, len(tables))
        return meta

    def _record(self, size: int, width: int) -> RecordedStep:
        began = time.perf_counter()
        token_ids = torch.zeros(size, dtype=torch.long, device=self.device)
        positions = torch.zeros(size, dtype=torch.long, device=self.device)
        metadata = self._metadata([[] for _ in self.windows], size, width)
        self.forward(token_ids, positions, metadata)
        graph, hidden = self.capture.record(lambda: self.forward(token_ids, positions, metadata), self.pool)
        step = RecordedStep(graph, token_ids, positions, metadata, hidden)
        self.recorded[(size, width)] = step
        logger.info(
            "%s: recorded the decode step of %d rows over tables of %d blocks in %.0f ms",
            self.capture.name,
            size,
            width,
            (time.perf_counter() - began) * 1e3,
        )
        return step

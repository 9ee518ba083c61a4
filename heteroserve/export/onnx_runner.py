"""Runs exported graphs with onnxruntime's CPU execution provider, under the shapes config.json promises.

A static graph takes exactly its sizes: shorter inputs are padded here with rows that write nothing (slot -1 or
position -1), longer ones are refused with the size that was exported, before onnxruntime sees them.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnxruntime as ort

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


class OnnxDecoder:
    """An export folder's prefill and decode graphs, each loaded on first use; threads 0: onnxruntime's default."""

    def __init__(self, folder: Path | str, threads: int = 0) -> None:
        self.folder = Path(folder)
        self.config = json.loads((self.folder / "config.json").read_text())
        self.paged = self.config["kv_layout"] == "paged"
        self.static = self.config["static"]
        self.threads = threads
        self._sessions: dict[str, ort.InferenceSession] = {}

    @property
    def cache_dtype(self) -> np.dtype:
        """The caches are in the exported dtype (numpy knows bfloat16 through ml_dtypes, onnx's dependency)."""
        return np.dtype(_NUMPY_DTYPES[self.config["dtype"]])

    def session(self, graph: str) -> ort.InferenceSession:
        if graph not in self._sessions:
            options = ort.SessionOptions()
            options.intra_op_num_threads = self.threads
            path = str(self.folder / self.config["graphs"][graph]["file"])
            self._sessions[graph] = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        return self._sessions[graph]

    def new_caches(self, num_blocks: int | None = None, batch: int | None = None) -> list[np.ndarray]:
        """Zeroed key and value caches of every layer: paged [num_blocks, block_size, Hkv, D], contiguous
        [batch, max_model_len, Hkv, D]."""
        c = self.config
        if self.paged:
            blocks = self.static.get("blocks", num_blocks)
            if blocks is None:
                raise ValueError("num_blocks: a paged cache needs its number of blocks")
            lead = (blocks, c["block_size"])
        else:
            lead = (self.static.get("batch", batch), c["max_model_len"])
        shape = (*lead, c["num_kv_heads"], c["head_dim"])
        return [np.zeros(shape, dtype=self.cache_dtype) for _ in range(2 * c["num_layers"])]

    def run(
        self,
        graph: str,
        input_ids: np.ndarray,
        positions: np.ndarray,
        seq_lens: np.ndarray,
        caches: list[np.ndarray],
        slot_mapping: np.ndarray | None = None,
        block_tables: np.ndarray | None = None,
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One step: float32 logits [B, S, vocab] of the given rows and the updated caches."""
        b, s = input_ids.shape
        rows = 1 if graph == "decode" else self.static.get("seq")
        batch = self.static.get("batch")
        if graph == "decode" and s != 1:
            raise ValueError(f"the decode graph takes one token per sequence, got {s}")
        if rows is not None and s > rows:
            raise ValueError(
                f"{s} tokens exceed the {graph} graph's static seq={rows} (exported with --static); "
                "split the prompt into chunks or export with a larger seq"
            )
        if batch is not None and b > batch:
            raise ValueError(f"{b} sequences exceed the graph's static batch={batch} (exported with --static)")
        if int(positions.max()) >= self.config["max_model_len"]:
            raise ValueError(
                f"position {int(positions.max())} is past the exported max_model_len {self.config['max_model_len']}"
            )
        width_b, width_s = (batch or b) - b, (rows or s) - s
        ids = np.pad(input_ids, ((0, width_b), (0, width_s)))
        pad_position = 0 if self.paged else -1
        pos = np.pad(positions, ((0, width_b), (0, width_s)), constant_values=pad_position)
        lens = np.pad(seq_lens, (0, width_b))
        feeds = [ids, pos, lens, *caches]
        if self.paged:
            slots = np.pad(slot_mapping, ((0, width_b), (0, width_s)), constant_values=-1)
            tables = self._pad_tables(block_tables, width_b)
            feeds += [slots, tables]
        names = [spec.name for spec in self.session(graph).get_inputs()]
        outputs = self.session(graph).run(None, dict(zip(names, feeds, strict=True)))
        return outputs[0][:b, :s], outputs[1:]

    def _pad_tables(self, tables: np.ndarray, extra_rows: int) -> np.ndarray:
        width = -(-self.config["max_model_len"] // self.config["block_size"]) if self.static else tables.shape[1]
        if tables.shape[1] > width:
            raise ValueError(f"block tables of {tables.shape[1]} blocks exceed the graph's {width} (max_model_len)")
        return np.pad(tables, ((0, extra_rows), (0, width - tables.shape[1])))

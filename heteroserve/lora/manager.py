"""A rank's adapters: read from their folders on first use (each rank reads its own share: the layers of its
pipeline stage, and with tensor parallelism the rows or columns of the projections it holds, as the base weights
are split), kept in host memory (up to max_cpu_loras, least recently used dropped first) and swapped into the
device's `max_loras` slots as steps need them."""

from __future__ import annotations

from collections import OrderedDict

import torch

from heteroserve.config import LoRAConfig
from heteroserve.lora.batch import LoRABatch
from heteroserve.lora.peft_adapter import AdapterWeights, load_adapter
from heteroserve.lora.request import LoRARequest
from heteroserve.lora.slots import LoRASlots
from heteroserve.model.sharding import ModelShard
from heteroserve.platforms.operators import OperatorTable


class LoRAManager:
    def __init__(
        self, config: LoRAConfig, shard: ModelShard, ops: OperatorTable, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config = config
        self.ops = ops
        self.shard = shard
        self.dtype = dtype  # the activations'
        self.device = device
        # The adapters' own: the model's, or the 16-bit one --lora-dtype names (the kernels widen it as they read).
        self.weights_dtype = dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
        self.slots = LoRASlots(shard.arch, config.max_loras, config.max_lora_rank, self.weights_dtype, device)
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.num_loads = 0  # adapters read from disk
        self.num_swaps = 0  # adapters written into a device slot

    def activate(self, adapters: list[LoRARequest]) -> dict[int, int]:
        """Makes a step's adapters resident (reading and swapping in those that are not): adapter id -> slot."""
        wanted = {lora.lora_int_id for lora in adapters}
        slots = {}
        for lora in adapters:
            slot = self.slots.lookup(lora.lora_int_id)
            if slot is None:
                slot = self.slots.place(lora.lora_int_id, self._weights(lora), wanted)
                self.num_swaps += 1
            slots[lora.lora_int_id] = slot
        return slots

    def batch_for(self, segments: list[tuple[int | None, int]]) -> LoRABatch | None:
        """The step's LoRA rows, given each scheduled request's slot (None: the base model) and row count in row
        order; None when no row runs under an adapter (the base model's step is untouched)."""
        runs = []
        offset = 0
        for slot, count in segments:
            if slot is not None and count:
                runs.append((offset, offset + count, slot))
            offset += count
        return LoRABatch(self.slots, runs, self.ops, self.dtype, self.device) if runs else None

    def _weights(self, lora: LoRARequest) -> AdapterWeights:
        weights = self._host.get(lora.lora_int_id)
        if weights is None:
            full = self.shard.full_arch
            weights = local_share(
                load_adapter(lora.lora_name, lora.lora_path, full, self.config.max_lora_rank, self.weights_dtype),
                self.shard,
            )
            self.num_loads += 1
            self._host[lora.lora_int_id] = weights
            while len(self._host) > self.config.host_capacity:
                self._host.popitem(last=False)
        self._host.move_to_end(lora.lora_int_id)
        return weights


def local_share(weights: AdapterWeights, shard: ModelShard) -> AdapterWeights:
    """The part of an adapter that modifies this rank's share of the model: the stage's layers (renumbered from 0);
    B's rows of a column-parallel projection (q, k, v, gate, up: each rank adds its own output columns) and A's
    columns of a row-parallel one (o, down: each rank's partial product is summed by the layer's all-reduce)."""
    layers = weights.layers[shard.layer_start : shard.layer_start + shard.arch.num_layers]
    local = []
    for modules in layers:
        kept = {}
        for module, (a, b) in modules.items():
            split = shard.split_of(module)
            if split is not None:
                kind, start, end = split
                a, b = (a, b[start:end].contiguous()) if kind == "rows" else (a[:, start:end].contiguous(), b)
            kept[module] = (a, b)
        local.append(kept)
    return AdapterWeights(weights.config, local)

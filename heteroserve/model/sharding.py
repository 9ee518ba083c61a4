"""Which part of a checkpoint a rank holds, and the slicing that takes it while the checkpoint streams in.

Tensor parallelism (Megatron's layout): q/k/v and gate/up are column-parallel (each rank owns whole heads
and a slice of the MLP's intermediate rows), o and down are row-parallel (the matching input columns; the
partial outputs are summed by an all-reduce), the embedding and LM head own a slice of the vocabulary.
KV heads are split like query heads, each with the query heads that read it, as evenly as they go (9 query and
3 KV heads over 2 ranks: 3 + 6 and 1 + 2); with fewer KV heads than ranks each rank keeps a copy of the one its
query heads read. Latent attention (DeepSeek-V2/V3) splits its query heads likewise (q_proj or q_b_proj rows,
kv_b_proj's per-head key and value rows, o_proj's columns) and keeps the latent on every rank: the latent
projections and the KV cache's one latent a token are replicated, as vLLM replicates them. MLP rows and
vocabulary rows are split as evenly as they go. Compressed weights slice themselves (ShardableWeight) in their
packed form: rows freely, columns at group borders.
Pipeline parallelism keeps the layers of the rank's stage, renumbered from 0.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from heteroserve.distributed.parallel_state import ParallelGroups, layer_range, vocab_range
from heteroserve.model.arch import ModelArch
from heteroserve.quantization.weight import ShardableWeight

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")
_EXPERT_DOWN_BIAS = re.compile(r"^mlp\.experts\.\d+\.down_proj\.bias$")
_SPLIT_MODULES = (
    "q_proj",
    "q_b_proj",
    "kv_b_proj",
    "k_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
    "embed_tokens",
    "lm_head",
    "o_proj",
    "down_proj",
)


@dataclass(frozen=True)
class ModelShard:
    """The part of the model one rank holds; `ModelShard.whole(arch)` is the unsharded model."""

    groups: ParallelGroups
    full_arch: ModelArch
    arch: ModelArch  # the local sizes: heads, KV heads, intermediate rows, layers and vocabulary rows
    vocab_start: int
    layer_start: int
    kv_head_start: int
    head_start: int = 0
    mlp_start: int = 0
    expert_start: int = 0  # of each routed expert's intermediate rows (every MoE layer's experts are alike)
    shared_start: int = 0  # of the shared experts' intermediate rows

    @classmethod
    def whole(cls, arch: ModelArch) -> ModelShard:
        return cls(ParallelGroups(), arch, arch, 0, 0, 0)

    @classmethod
    def of(cls, arch: ModelArch, groups: ParallelGroups) -> ModelShard:
        tp, r = groups.tp_size, groups.tp_rank
        check_tensor_parallel(arch, tp, groups.expert_parallel)
        first, last = layer_range(arch.num_layers, groups.pp_rank, groups.pp_size)
        vocab_start, vocab_end = vocab_range(arch.vocab_size, r, tp)
        if arch.num_kv_heads >= tp:  # whole KV groups: a KV head and the query heads that read it
            kv_start, kv_end = _even_split(arch.num_kv_heads, r, tp)
            group = arch.num_heads // arch.num_kv_heads
            q_start, q_heads, kv_heads = kv_start * group, (kv_end - kv_start) * group, kv_end - kv_start
        else:  # replicated: the KV head of this rank's query heads
            q_heads, q_start = arch.num_heads // tp, r * (arch.num_heads // tp)
            kv_heads, kv_start = 1, r * arch.num_kv_heads // tp
        mlp_start, mlp_end = _even_split(arch.intermediate_size, r, tp)
        moe_specs = {layer.moe for layer in arch.layers if layer.moe is not None}
        if len(moe_specs) > 1:
            raise ValueError("tensor parallelism over MoE layers of different shapes is not implemented")
        expert_range = shared_range = (0, 0)
        layers = arch.layers[first:last]
        if moe_specs:
            moe = moe_specs.pop()
            shared_range = _even_split(moe.shared_intermediate_size, r, tp)
            if groups.expert_parallel:  # whole experts [first, last) on this rank
                expert_range = (0, moe.intermediate_size)
                local = {"local_experts": _even_split(moe.num_experts, r, tp)}
            else:
                expert_range = _even_split(moe.intermediate_size, r, tp)
                local = {"intermediate_size": expert_range[1] - expert_range[0]}
            local_moe = dataclasses.replace(moe, shared_intermediate_size=shared_range[1] - shared_range[0], **local)
            layers = tuple(dataclasses.replace(x, moe=local_moe) if x.moe else x for x in layers)
        local = dataclasses.replace(
            arch,
            num_heads=q_heads,
            num_kv_heads=kv_heads,
            intermediate_size=mlp_end - mlp_start,
            num_layers=last - first,
            layers=layers,
            vocab_size=vocab_end - vocab_start,
        )
        return cls(
            groups, arch, local, vocab_start, first, kv_start, q_start, mlp_start, expert_range[0], shared_range[0]
        )

    def take(self, tensors: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """The checkpoint's tensors as this rank holds them (others skipped), under local layer numbers."""
        for name, tensor in tensors:
            match = _LAYER.match(name)
            if match is None:
                yield name, self._slice(name, tensor)
                continue
            index = int(match.group(1)) - self.layer_start
            if 0 <= index < self.arch.num_layers and self._holds(index, match.group(2)):
                yield f"model.layers.{index}.{match.group(2)}", self._slice(match.group(2), tensor)

    def _holds(self, layer: int, name: str) -> bool:
        """Whether this rank keeps a layer tensor: with expert parallelism, only its own experts'."""
        expert = _EXPERT.match(name)
        moe = self.arch.layers[layer].moe
        if expert is None or moe is None or moe.local_experts is None:
            return True
        first, last = moe.local_experts
        return first <= int(expert.group(1)) < last

    def split_of(self, module: str, mlp_kind: str = "dense") -> tuple[str, int, int] | None:
        """How this rank splits a projection or table (its name's last part, e.g. q_proj): ("rows" | "columns",
        start, end) of the full weight, or None where it is replicated (norms, or one rank). mlp_kind: whose
        gate/up/down projection it is: the dense MLP's, a routed expert's ("expert") or the shared experts'."""
        if self.groups.tp_size == 1:
            return None
        a, d = self.arch, self.full_arch.head_dim
        q = (self.head_start * d, (self.head_start + a.num_heads) * d)
        kv = (self.kv_head_start * d, (self.kv_head_start + a.num_kv_heads) * d)
        o = q
        mla = next((layer.mla for layer in self.full_arch.layers if layer.mla is not None), None)
        if mla is not None:  # per query head: its q rows, its key and value rows of kv_b, its value's o columns

            def heads(width: int) -> tuple[int, int]:
                return self.head_start * width, (self.head_start + a.num_heads) * width

            q = heads(mla.qk_nope_head_dim + mla.qk_rope_head_dim)
            kv = heads(mla.qk_nope_head_dim + mla.v_head_dim)
            o = heads(mla.v_head_dim)
        mlp = (self.mlp_start, self.mlp_start + a.intermediate_size)
        if mlp_kind != "dense":
            moe = next(layer.moe for layer in a.layers if layer.moe is not None)
            start = self.expert_start if mlp_kind == "expert" else self.shared_start
            mlp = (start, start + (moe.intermediate_size if mlp_kind == "expert" else moe.shared_intermediate_size))
        vocab = (self.vocab_start, self.vocab_start + a.vocab_size)
        rows = {"q_proj": q, "q_b_proj": q, "k_proj": kv, "v_proj": kv, "kv_b_proj": kv, "gate_proj": mlp}
        rows |= {"up_proj": mlp, "embed_tokens": vocab, "lm_head": vocab}
        columns = {"o_proj": o, "down_proj": mlp}
        if module in rows:
            return ("rows", *rows[module])
        if module in columns:
            return ("columns", *columns[module])
        return None

    def _slice(self, name: str, tensor):
        if name == "self_attn.sinks" and self.groups.tp_size > 1:  # one per query head
            return tensor[self.head_start : self.head_start + self.arch.num_heads].clone()
        if _EXPERT_DOWN_BIAS.match(name) and self.groups.tp_rank > 0 and not self.groups.expert_parallel:
            # each rank's partial sum of a sliced expert would add the bias again before the all-reduce
            return torch.zeros_like(tensor)
        mlp_kind = "expert" if "mlp.experts." in name else "shared" if "mlp.shared_experts." in name else "dense"
        for module in _SPLIT_MODULES:
            if f"{module}." in name:
                split = self.split_of(module, mlp_kind)
                if split is None or (split[0] == "columns" and f"{module}.weight" not in name):
                    return tensor  # a row-parallel projection's bias is not split
                kind, start, end = split
                return slice_rows(tensor, start, end) if kind == "rows" else slice_columns(tensor, start, end, name)
        return tensor  # norms, q/k norms: replicated


def check_tensor_parallel(arch: ModelArch, tp: int, expert_parallel: bool = False) -> None:
    """A clear error when the model's heads cannot be split over `tp` ranks: up to one rank per KV head, whole
    KV groups per rank; beyond that, the query heads must divide evenly and each rank's fall in one KV group.
    Expert parallelism needs a model with experts, and at least one expert a rank."""
    moe = next((layer.moe for layer in arch.layers if layer.moe is not None), None)
    if expert_parallel and moe is None:
        raise ValueError(f"--enable-expert-parallel: {arch.model_type} has no mixture-of-experts layers")
    if expert_parallel and moe.num_experts < tp:
        raise ValueError(f"--enable-expert-parallel: {moe.num_experts} experts cannot give each of {tp} ranks one")
    if tp > 1 and any(layer.qk_norm == "projection" for layer in arch.layers):
        raise ValueError(
            f"{arch.model_type} normalises q and k over all heads at once, which tensor parallelism would split; "
            "run it on one rank (tensor_parallel_size=1)"
        )
    problem = _split_problem(arch, tp)
    if problem:
        sizes = [n for n in range(1, arch.num_heads + 1) if not _split_problem(arch, n)]
        raise ValueError(f"{problem} (sizes that work for this model: {sizes})")


def _split_problem(arch: ModelArch, tp: int) -> str | None:
    if tp <= arch.num_kv_heads:
        return None
    problems = []
    if arch.num_heads % tp:
        problems.append(f"num_attention_heads={arch.num_heads} is not divisible by tensor_parallel_size={tp}")
    if tp % arch.num_kv_heads:
        problems.append(
            f"tensor_parallel_size={tp} is above num_key_value_heads={arch.num_kv_heads} and not a multiple of it"
        )
    return "; ".join(problems) or None


def _even_split(total: int, rank: int, ranks: int) -> tuple[int, int]:
    """[start, end) of rank's share when `total` items are split over `ranks` as evenly as they go."""
    return rank * total // ranks, (rank + 1) * total // ranks


def slice_rows(tensor: torch.Tensor | ShardableWeight, start: int, end: int) -> torch.Tensor | ShardableWeight:
    if isinstance(tensor, torch.Tensor):
        return tensor[start:end].clone()  # a copy, so the whole tensor can be freed
    if not isinstance(tensor, ShardableWeight):
        raise ValueError(_unsplittable(tensor))
    return tensor.slice_rows(start, end)


def slice_columns(
    tensor: torch.Tensor | ShardableWeight, start: int, end: int, name: str
) -> torch.Tensor | ShardableWeight:
    if isinstance(tensor, torch.Tensor):
        return tensor[:, start:end].contiguous()
    if not isinstance(tensor, ShardableWeight):
        raise ValueError(_unsplittable(tensor))
    try:
        return tensor.slice_columns(start, end)
    except ValueError as exc:
        raise ValueError(
            f"{name}: {exc}; choose another tensor_parallel_size or load with quantization='none'"
        ) from exc


def _unsplittable(weight: object) -> str:
    return f"tensor parallelism cannot split {type(weight).__name__} weights; load with quantization='none'"

"""The projections an adapter may modify, as our decoder fuses them: q/k/v into one qkv product and gate/up into
one gate_up product, so an adapter's per-module matrices are laid out per fused product."""

from __future__ import annotations

from dataclasses import dataclass

from heteroserve.model.arch import ModelArch


@dataclass(frozen=True)
class FusedTarget:
    """One of the decoder's products: its input width and its PEFT sub-modules with their output widths, in the
    order their outputs are concatenated."""

    name: str
    in_features: int
    parts: tuple[tuple[str, int], ...]

    @property
    def out_features(self) -> int:
        return sum(width for _, width in self.parts)


def fused_targets(arch: ModelArch) -> tuple[FusedTarget, ...]:
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return (
        FusedTarget("qkv", hidden, (("q_proj", q), ("k_proj", kv), ("v_proj", kv))),
        FusedTarget("o", q, (("o_proj", hidden),)),
        FusedTarget("gate_up", hidden, (("gate_proj", inter), ("up_proj", inter))),
        FusedTarget("down", inter, (("down_proj", hidden),)),
    )


def module_names(arch: ModelArch) -> tuple[str, ...]:
    """PEFT's names of every module an adapter may target (q_proj, ..., down_proj)."""
    return tuple(part for target in fused_targets(arch) for part, _ in target.parts)

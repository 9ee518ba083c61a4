"""The operator table: the kernels the model calls, chosen by the platform, with a CPU fallback.

Model code never calls a device kernel directly: it calls `ops.rms_norm(...)` and so on, and the table
runs the platform's kernel. When the platform has no kernel for an operator, or its kernel says it
cannot handle the call (NotImplementedError, or a device error that means "unsupported"), the plain-torch
reference runs on the CPU and the result moves back to the device. That keeps a new device usable before
every kernel exists; each fallback is logged once per operator and counted for the metrics.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from heteroserve.model.arch import MoESpec
from heteroserve.platforms import reference_ops
from heteroserve.platforms.attention import ScoreModifiers
from heteroserve.platforms.lora_rows import LoRARows
from heteroserve.quantization.act_order import PermutedInput
from heteroserve.quantization.int4 import Int4Weight
from heteroserve.quantization.int8 import Int8Weight
from heteroserve.quantization.weight import CompressedWeight

logger = logging.getLogger(__name__)

Kernel = Callable[..., object]
# A loaded weight (a tensor or a heteroserve.quantization weight) -> the form a linear op's kernel multiplies by.
WeightPacker = Callable[..., "torch.Tensor | CompressedWeight"]
CPU_FALLBACK = "cpu fallback"
REFERENCE_LINEAR = "torch reference, dequantised on every product"
# The loaded compressed formats, whose own matmul is the reference product.
REFERENCE_WEIGHTS = (Int4Weight, Int8Weight)
FORMAT_NAMES: dict[type, str] = {Int4Weight: "int4", Int8Weight: "int8"}
_UNSUPPORTED_MESSAGE = re.compile(r"not implemented|not supported|unsupported", re.IGNORECASE)


class LinearOp:
    """y = x W^T + b. `prepare` runs once per weight at load time (e.g. to repack it for a kernel).

    A compressed weight multiplies itself (`CompressedWeight.matmul`): the loaded formats with the plain-torch
    reference, a platform's packed forms with its kernel. Which packed form a loaded weight becomes is the
    `formats` table, keyed by the loaded weight's type, so a platform (or a plugin built on one) adds a kernel for
    a format with `register_format` instead of editing a chain of type checks.

    Not in the fallback table: a kernel that repacks weights owns their layout, which the CPU reference
    could not read. Every torch device has a matrix product, so the plain one is always there."""

    name = "torch.linear"

    def __init__(self, formats: Mapping[type, WeightPacker] | None = None) -> None:
        self.formats: dict[type, WeightPacker] = dict(formats or {})
        # Compressed formats left in their loaded form, whose products dequantise the weight on every call: the
        # reason per format (start-up WARNING, `heteroserve env`); their calls are counted in `fallbacks`.
        self.reference_formats: dict[str, str] = {}
        self.fallbacks: Counter[str] = Counter()  # the operator table puts the platform's counter here

    def register_format(self, weight_type: type, pack: WeightPacker) -> None:
        """Weights of `weight_type` (and its subclasses) are prepared by `pack` from now on."""
        self.formats[weight_type] = pack

    def prepare(self, weight: torch.Tensor | CompressedWeight) -> torch.Tensor | CompressedWeight:
        """A projection weight (a tensor or a heteroserve.quantization weight) in the form __call__ reads."""
        pack = self.packer_for(weight)
        if pack is not None:
            return pack(weight)
        if isinstance(weight, (*REFERENCE_WEIGHTS, PermutedInput)):
            return self.keep_reference(weight, f"{self.name} has no kernel for it")
        return weight

    def packer_for(self, weight: object) -> WeightPacker | None:
        """The registered packer of the nearest type in `weight`'s class hierarchy, or None."""
        return next((self.formats[cls] for cls in type(weight).__mro__ if cls in self.formats), None)

    def prepare_lm_head(self, weight: torch.Tensor | CompressedWeight) -> torch.Tensor | CompressedWeight:
        """The LM head (possibly the tied embedding's copy); platforms may keep it in a different form."""
        return self.prepare(weight)

    def keep_reference(self, weight: CompressedWeight, why: str) -> CompressedWeight:
        """`weight` stays in its loaded form, multiplied by the reference (dequantised on every product): said
        once per format at WARNING, listed by `weight_formats`, and counted per call."""
        name = format_name(weight)
        if name not in self.reference_formats:
            logger.warning("%s weights run the torch reference (dequantised on every product): %s", name, why)
        self.reference_formats[name] = why
        return weight

    def planned_formats(self) -> dict[str, str]:
        """The kernel this op gives each weight format at load, by format name; platforms with kernels override."""
        return {"dense": self.name, "int4": REFERENCE_LINEAR, "int8": REFERENCE_LINEAR}

    def weight_formats(self) -> dict[str, str]:
        """The kernel each weight format's products run (`heteroserve env`): the plan, with the formats that
        `keep_reference` left to the reference and why."""
        kernels = self.planned_formats()
        kernels.update({name: f"{REFERENCE_LINEAR}: {why}" for name, why in self.reference_formats.items()})
        return kernels

    def count_reference(self, weight: object) -> None:
        """Counts a product by a weight `keep_reference` left in its loaded form."""
        if isinstance(weight, REFERENCE_WEIGHTS) or (
            isinstance(weight, PermutedInput) and isinstance(weight.weight, REFERENCE_WEIGHTS)
        ):
            self.fallbacks[f"linear {format_name(weight)}"] += 1

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor | CompressedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight, bias)
        self.count_reference(weight)
        return weight.matmul(x, bias)


def format_name(weight: object) -> str:
    """A loaded weight's format as `heteroserve env` and the metrics name it (int4, int8, act-order int4, ...)."""
    if isinstance(weight, PermutedInput):
        return f"act-order {format_name(weight.weight)}"
    if isinstance(weight, torch.Tensor):
        return str(weight.dtype).removeprefix("torch.")
    return FORMAT_NAMES.get(type(weight), type(weight).__name__)


@dataclass(frozen=True)
class DecodeLayerWeights:
    """A decoder layer as a fused decode kernel needs it: weights as the linear op prepared them, and the layer's
    traits (model.arch.LayerSpec.traits: the blocks where it differs from Llama's), so that a fuser refuses the
    layers with a trait it does not implement (model.arch.unimplemented_traits)."""

    input_norm: torch.Tensor | None  # None where the layer has no pre-norms (a trait)
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None  # RMSNorm weights of q and k (the qk_norm trait says how)
    qkv: object
    qkv_bias: torch.Tensor | None
    o_proj: object
    post_norm: torch.Tensor | None
    gate_up: object  # None where the MLP is a mixture of experts
    down: object
    eps: float
    num_heads: int
    scale: float
    cos: torch.Tensor  # the layer's rotary tables [max_positions, head_dim]
    sin: torch.Tensor
    traits: dict[str, object]
    # How the model runs, beyond the layer's blocks: a fuser may not implement these either.
    multimodal_rope: bool = False  # M-RoPE (Qwen2-VL): each rotary column reads one of several position axes
    tensor_parallel_size: int = 1  # >1: the projections are a rank's slices and their outputs are all-reduced
    # A mixture-of-experts MLP: its routed experts as the platform's experts fuser bound them (None: a dense MLP,
    # or experts the fuser did not take), its shared experts' projections (None: none) and the weight [1, hidden]
    # in the model's dtype of their sigmoid gate (Qwen2-MoE; None: ungated).
    experts: FusedExperts | None = None
    shared_gate_up: object = None
    shared_down: object = None
    shared_gate: torch.Tensor | None = None


# (x, positions, k_cache, v_cache, paged_attention.AttentionMetadata of a decode-only step) -> the layer's output.
# One whose `takes_lora` is true also takes the step's adapters: (A^T, B^T of every slot for qkv, o, gate_up and
# down, LoRARows.segments); others leave steps with adapter rows to the model's Python path.
FusedDecodeLayer = Callable[..., torch.Tensor]
# Given a layer's weights, the platform's one-call decode layer for them, or None where it has none.
DecodeLayerFuser = Callable[[DecodeLayerWeights], FusedDecodeLayer | None]


class FusedExperts(Protocol):
    """A platform's one-call kernels for a MoE layer's routing (its router's product included) and its routed
    experts."""

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] float32, expert ids [T, top_k]) of each row, as model.moe.route chooses them from
        the router's float32 logits, whose bits for a row are the same at every row count."""

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The weighted sum [T, hidden] in float32 of each row's experts (`ids`, `weights`: [T, top_k])."""


# Given a MoE layer's routed experts (gate_up and down projections as the linear op prepared them, the activation's
# operator name, the id of the first of them), its router (float32 weight, bias or None), its routing (the spec,
# the correction bias or None), the platform's one-call kernel for them, or None where it has none.
ExpertsFuser = Callable[
    [list, list, str, int, torch.Tensor, torch.Tensor | None, MoESpec, torch.Tensor | None], FusedExperts | None
]


@dataclass(frozen=True)
class OperatorSpec:
    reference: Kernel
    mutates: tuple[int, ...] = ()  # positional arguments written in place: copied back after a CPU fallback


OPERATORS: dict[str, OperatorSpec] = {
    "rms_norm": OperatorSpec(reference_ops.rms_norm),
    "rotary": OperatorSpec(reference_ops.rotary),
    "silu_and_mul": OperatorSpec(reference_ops.silu_and_mul),
    "gelu_tanh_and_mul": OperatorSpec(reference_ops.gelu_tanh_and_mul),
    "write_kv": OperatorSpec(reference_ops.write_kv, mutates=(2, 3)),
    "prefill_attention": OperatorSpec(reference_ops.prefill_attention),
    "bidirectional_attention": OperatorSpec(reference_ops.bidirectional_attention),
    "decode_attention": OperatorSpec(reference_ops.decode_attention),
    "argmax_rows": OperatorSpec(reference_ops.argmax_rows),
    "lora_add": OperatorSpec(reference_ops.lora_add, mutates=(0,)),
}


def means_unsupported(exc: BaseException) -> bool:
    """torch reports a missing backend kernel as NotImplementedError; vendor stacks often as RuntimeError."""
    if isinstance(exc, NotImplementedError):
        return True
    return isinstance(exc, RuntimeError) and _UNSUPPORTED_MESSAGE.search(str(exc)) is not None


def kernel_name(kernel: Kernel) -> str:
    explicit = getattr(kernel, "kernel_name", None)
    if explicit:
        return explicit
    qualname = getattr(kernel, "__qualname__", type(kernel).__qualname__)
    module = getattr(kernel, "__module__", "") or ""
    if module == reference_ops.__name__:
        return "torch reference"
    return f"{module}.{qualname}" if module else qualname


class OperatorTable:
    """Named operators for the model; `fallbacks` counts calls that ran on the CPU, by operator."""

    def __init__(
        self,
        linear: LinearOp,
        kernels: Mapping[str, Kernel],
        fallbacks: Counter[str] | None = None,
        is_unsupported: Callable[[BaseException], bool] = means_unsupported,
        fuse_decode_layer: DecodeLayerFuser | None = None,
        fuse_experts: ExpertsFuser | None = None,
    ) -> None:
        unknown = set(kernels) - set(OPERATORS)
        if unknown:
            raise ValueError(f"unknown operators {sorted(unknown)}; known: {', '.join(OPERATORS)}")
        self.linear = linear
        self.kernels = dict(kernels)
        self.fallbacks = fallbacks if fallbacks is not None else Counter()
        linear.fallbacks = self.fallbacks
        self.is_unsupported = is_unsupported
        self.fuse_decode_layer = fuse_decode_layer  # optional: the operators above, chained in one call
        self.fuse_experts = fuse_experts  # optional: a MoE layer's routed experts in one call
        self._logged: set[str] = set()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.call("rms_norm", x, weight, eps)

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.call("rotary", positions, q, k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.call("silu_and_mul", x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.call("gelu_tanh_and_mul", x)

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        self.call("write_kv", k, v, k_cache, v_cache, slots)

    def prefill_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        modifiers: ScoreModifiers | None = None,
    ) -> torch.Tensor:
        """modifiers: passed to the kernel, as a last argument, only where the layer modifies its scores."""
        return self.call("prefill_attention", q, keys, values, mask, scale, *_modifiers_argument(modifiers))

    def bidirectional_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return self.call("bidirectional_attention", q, keys, values, scale)

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
        modifiers: ScoreModifiers | None = None,
    ) -> torch.Tensor:
        """modifiers: as in prefill_attention."""
        return self.call(
            "decode_attention", q, k_cache, v_cache, block_tables, mask, scale, *_modifiers_argument(modifiers)
        )

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.call("argmax_rows", x)

    def lora_add(
        self, y: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor, rows: LoRARows
    ) -> torch.Tensor:
        return self.call("lora_add", y, x, a_t, b_t, rows)

    def call(self, name: str, *args):
        kernel = self.kernels.get(name)
        if kernel is not None:
            try:
                return kernel(*args)
            except (NotImplementedError, RuntimeError) as exc:
                if not self.is_unsupported(exc):
                    raise
                self._note_fallback(name, f"its kernel raised {type(exc).__name__}: {exc}")
        else:
            self._note_fallback(name, "the platform has no kernel for it")
        return self._on_cpu(name, args)

    def _note_fallback(self, name: str, why: str) -> None:
        self.fallbacks[name] += 1
        if name not in self._logged:
            self._logged.add(name)
            logger.warning("operator %s runs on the CPU (reference implementation): %s", name, why)

    def _on_cpu(self, name: str, args: tuple):
        spec = OPERATORS[name]
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        result = spec.reference(*cpu_args)
        for i in spec.mutates:
            if cpu_args[i] is not args[i]:
                args[i].copy_(cpu_args[i])
        return _to_device(result, device)

    def describe(self) -> dict[str, str]:
        """The kernel each operator runs ('cpu fallback' where the platform has none)."""
        names = {"linear": self.linear.name}
        names.update({f"linear {name}": kernel for name, kernel in self.linear.weight_formats().items()})
        for name in OPERATORS:
            kernel = self.kernels.get(name)
            names[name] = CPU_FALLBACK if kernel is None else kernel_name(kernel)
        names["decode_layer"] = (
            kernel_name(self.fuse_decode_layer) if self.fuse_decode_layer else "operator by operator"
        )
        names["moe_experts"] = kernel_name(self.fuse_experts) if self.fuse_experts else "expert by expert"
        return names


def _modifiers_argument(modifiers: ScoreModifiers | None) -> tuple[ScoreModifiers, ...]:
    """The attention kernels' contract: score modifiers (soft-capping, sinks) come as a last argument only for the
    layers that have them, so a kernel without them serves every other layer; one that takes the argument and does
    not implement what it holds raises NotImplementedError, and the reference runs instead (logged and counted as
    a fallback)."""
    return () if modifiers is None else (modifiers,)


def _to_device(result, device: torch.device):
    if isinstance(result, torch.Tensor):
        return result.to(device)
    if isinstance(result, tuple):
        return tuple(_to_device(r, device) for r in result)
    return result

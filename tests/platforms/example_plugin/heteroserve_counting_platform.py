"""A worked example of a heteroserve platform plugin (docs/PLATFORMS.md), used by the tests.

Its "device" is the CPU, so it runs anywhere, but it brings its own kernel table and counts each call,
which shows that the engine really goes through the plugin. Five entry points share the module:

- `counting`: every operator has a kernel of the plugin's own;
- `partial`: declares rms_norm and decode_attention unsupported, so those run through the CPU fallback;
- `flaky`: its silu_and_mul and prefill_attention kernels raise NotImplementedError at run time;
- `contiguous`: brings its own attention backend (`ContiguousAttentionBackend`) instead of paged attention
  over the operator table, the way a device whose kernels take other metadata does, and its own kernel for
  4-bit weights (`ExampleInt4Weight`), registered with the linear op rather than written into heteroserve;
- `absent`: a plugin whose device is not present on this machine (its function returns None).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heteroserve.platforms.attention import AttentionBackend, AttentionStep
from heteroserve.platforms.cpu.platform import CpuPlatform
from heteroserve.platforms.operators import LinearOp, OperatorTable
from heteroserve.quantization.int4 import Int4Weight
from heteroserve.worker.model_runner import ModelRunner

KERNEL_CALLS: Counter[str] = Counter()  # operator -> calls that reached this plugin's kernels


def _counted(name: str, kernel: Callable) -> Callable:
    def run(*args):
        KERNEL_CALLS[name] += 1
        return kernel(*args)

    run.kernel_name = f"counting.{name}"
    return run


def _no_kernel(*args):
    raise NotImplementedError("the example device has no kernel for this call")


class CountingPlatform(CpuPlatform):
    name = "counting"

    def operator_kernels(self, dtype: torch.dtype, kernels: str = "auto") -> dict[str, Callable]:
        return {name: _counted(name, kernel) for name, kernel in super().operator_kernels(dtype, kernels).items()}


class PartialPlatform(CountingPlatform):
    name = "partial"
    unsupported_operators = frozenset({"rms_norm", "decode_attention"})


class FlakyPlatform(CountingPlatform):
    name = "flaky"

    def operator_kernels(self, dtype: torch.dtype, kernels: str = "auto") -> dict[str, Callable]:
        table = super().operator_kernels(dtype, kernels)
        table["silu_and_mul"] = _counted("silu_and_mul", _no_kernel)
        table["prefill_attention"] = _counted("prefill_attention", _no_kernel)
        return table


@dataclass
class ContiguousRequest:
    rows: slice  # the request's query rows in the step
    key_slots: torch.Tensor | None  # [seq_len] each token's cache slot; None: a whole prompt, its own keys
    mask: torch.Tensor  # [query_len, seq_len] True where a query attends to a key


@dataclass
class ContiguousMetadata:
    slot_mapping: torch.Tensor
    requests: list[ContiguousRequest]


class ContiguousAttentionBackend(AttentionBackend):
    """Attention a request at a time: its keys and values gathered from the cache into contiguous tensors by
    slot, then one SDPA call. Decodes, drafts and prefill chunks take the same path; a whole prompt attends over
    its own keys as computed, unrounded by a narrower cache, as the reference does. Its cache is laid out heads
    first, [blocks, heads, block_size, head_size], as some devices' paged kernels want. Its calls are counted."""

    name = "contiguous"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_size)

    def build_metadata(self, step: AttentionStep) -> ContiguousMetadata:
        KERNEL_CALLS["attention.build_metadata"] += 1
        bs, device = step.block_size, step.device
        requests = []
        for i in range(step.num_requests):
            table = torch.tensor(step.block_tables[i], dtype=torch.long)
            positions = torch.arange(step.seq_lens[i])
            slots = table[positions // bs] * bs + positions % bs
            queries = torch.arange(step.context_len(i), step.seq_lens[i])[:, None]
            mask = positions[None, :] <= queries
            if step.sliding_window is not None:
                mask &= positions[None, :] > queries - step.sliding_window
            rows = slice(step.query_start_loc[i], step.query_start_loc[i + 1])
            key_slots = slots.to(device) if step.context_len(i) else None
            requests.append(ContiguousRequest(rows, key_slots, mask.to(device)))
        return ContiguousMetadata(torch.tensor(step.slot_mapping, dtype=torch.long, device=device), requests)

    def forward(self, q, k, v, k_cache, v_cache, metadata: ContiguousMetadata, scale: float) -> torch.Tensor:
        KERNEL_CALLS["attention.forward"] += 1
        bs = k_cache.shape[2]

        def at(slots: torch.Tensor) -> tuple[torch.Tensor, slice, torch.Tensor]:  # [n, heads, D] through indexing
            return slots // bs, slice(None), slots % bs

        k_cache[at(metadata.slot_mapping)] = k.to(k_cache.dtype)
        v_cache[at(metadata.slot_mapping)] = v.to(v_cache.dtype)
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for request in metadata.requests:
            if request.key_slots is None:
                keys, values = k[request.rows], v[request.rows]
            else:
                keys, values = k_cache[at(request.key_slots)].to(q.dtype), v_cache[at(request.key_slots)].to(q.dtype)
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)
            values = values.repeat_interleave(group, dim=1).transpose(0, 1)
            queries = q[request.rows].transpose(0, 1)
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=request.mask, scale=scale)
            out[request.rows] = attended.transpose(0, 1)
        return out


@dataclass
class ExampleInt4Weight:
    """The example device's form of a 4-bit weight (heteroserve.quantization.weight.CompressedWeight): its
    product unpacks the nibbles group by group in the activations' dtype and multiplies. Its calls are counted."""

    weight: Int4Weight

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.dequantize(dtype)

    def to(self, device: torch.device) -> ExampleInt4Weight:
        return ExampleInt4Weight(self.weight.to(device))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        KERNEL_CALLS["linear.int4"] += 1
        w = self.weight
        nibbles = torch.stack((w.packed & 15, w.packed >> 4), dim=-1).flatten(1)
        groups = nibbles.to(x.dtype).unflatten(1, (-1, w.group_size)) - 8
        dense = groups * w.scale.to(x.dtype)[..., None] + w.zero.to(x.dtype)[..., None]
        return F.linear(x, dense.flatten(1), bias)


class CountingModelRunner(ModelRunner):
    """The worker's model runner, named by the platform (Platform.model_runner_class): here it counts steps; a
    device would capture and replay graphs or keep its own input buffers."""

    def execute(self, output):
        KERNEL_CALLS["runner.execute"] += 1
        return super().execute(output)


class ContiguousPlatform(CountingPlatform):
    name = "contiguous"
    model_runner_class = f"{__name__}.CountingModelRunner"

    def linear_op(self, dtype: torch.dtype, kernels: str = "auto") -> LinearOp:
        op = super().linear_op(dtype, kernels)
        op.register_format(Int4Weight, ExampleInt4Weight)
        return op

    def get_attn_backend(self, ops: OperatorTable) -> AttentionBackend:
        return ContiguousAttentionBackend()


# Entry points: each returns the platform class's qualified name, or None when the device is absent.
def counting() -> str:
    return f"{__name__}.CountingPlatform"


def partial() -> str:
    return f"{__name__}.PartialPlatform"


def flaky() -> str:
    return f"{__name__}.FlakyPlatform"


def contiguous() -> str:
    return f"{__name__}.ContiguousPlatform"


def absent() -> None:
    return None

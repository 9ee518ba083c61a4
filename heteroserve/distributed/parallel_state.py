"""A rank's place in the tensor x pipeline grid and the collectives the model needs.

Ranks are numbered stage-major: rank = pp_rank * tp_size + tp_rank, so a pipeline stage's tensor-parallel
ranks are consecutive (and on one node when a node holds whole stages). The single-rank instance makes
every collective a no-op, so the model code is the same with and without parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

# A collective that waits longer than this fails instead of hanging (an idle engine pings more often).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass
class ParallelGroups:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: object = None  # torch ProcessGroup of this stage's tensor-parallel ranks
    control_group: object = None  # gloo group of all ranks for Python objects (steps, results)
    expert_parallel: bool = False  # MoE layers: each tensor-parallel rank holds whole experts, not slices of all
    # The backend reduces host tensors only (gloo beside a device without a collective library of its own): each
    # collective copies the device tensor to the host and back.
    through_host: bool = False

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def sampler_rank(self) -> int:
        """The rank that samples: tensor rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size

    @property
    def samples(self) -> bool:
        return self.rank == self.sampler_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums a row-parallel layer's partial outputs over the stage's tensor ranks."""
        if self.tp_size > 1:
            staged = self._staged(x)
            dist.all_reduce(staged, group=self.tp_group)
            if staged is not x:
                x.copy_(staged)
        return x

    def _staged(self, x: torch.Tensor) -> torch.Tensor:
        """`x` itself, or its host copy where collectives go through the host."""
        return x.cpu() if self.through_host and x.device.type != "cpu" else x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Vocabulary-parallel logits [R, shard] -> the full [R, vocab] on the sampling rank, None elsewhere."""
        if self.tp_size == 1:
            return local
        shard = vocab_shard_size(vocab_size, self.tp_size)
        padded = self._staged(F.pad(local, (0, shard - local.shape[-1])).contiguous())
        dst = self.pp_rank * self.tp_size
        parts = [torch.empty_like(padded) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(padded, parts, dst=dst, group=self.tp_group)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[..., :vocab_size].to(local.device)

    def send_hidden(self, x: torch.Tensor) -> None:
        """Hands a stage's output to the same tensor rank of the next stage."""
        dist.send(self._staged(x.contiguous()), dst=self.rank + self.tp_size)

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device="cpu" if self.through_host else device)
        dist.recv(x, src=self.rank - self.tp_size)
        return x.to(device)


def vocab_shard_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size)


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The token ids [start, end) whose embedding rows and logits this tensor rank holds."""
    shard = vocab_shard_size(vocab_size, tp_size)
    return min(tp_rank * shard, vocab_size), min((tp_rank + 1) * shard, vocab_size)


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The decoder layers [start, end) of a pipeline stage; earlier stages take the remainder."""
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split over pipeline_parallel_size={pp_size}")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)


def init_parallel_groups(
    rank: int,
    tp_size: int,
    pp_size: int,
    backend: str,
    master_addr: str,
    master_port: int,
    through_host: bool = False,
) -> ParallelGroups:
    """Joins the TCP rendezvous at master_addr:master_port and builds the groups (every rank must call this).
    through_host: the backend takes host tensors only (ParallelGroups.through_host)."""
    world = tp_size * pp_size
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    tp_group = None
    for stage in range(pp_size):  # every rank creates every group, as torch.distributed requires
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)), timeout=COLLECTIVE_TIMEOUT)
        if rank // tp_size == stage:
            tp_group = group
    return ParallelGroups(
        rank % tp_size, tp_size, rank // tp_size, pp_size, tp_group, control, through_host=through_host
    )

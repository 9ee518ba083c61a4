"""One rank: joins the process groups, loads its share of the model and runs the steps it is handed.

Every executor (in-process, worker processes, Ray actors) drives the same `Worker` with the same step deltas
(step_wire.py); only how a step reaches it and how the sampled tokens get back differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from heteroserve.config import EngineConfig
from heteroserve.core.kv_cache_groups import KVGroupSpec
from heteroserve.distributed.parallel_state import ParallelGroups, init_parallel_groups
from heteroserve.model.encoder import EncoderModel
from heteroserve.model.layers.pooler import PoolerSpec
from heteroserve.model.loader import load_model
from heteroserve.model.sharding import check_tensor_parallel
from heteroserve.platforms import Platform, resolve_platform
from heteroserve.platforms.plugins import load_class
from heteroserve.worker.draft_model import DraftModel, load_draft_model
from heteroserve.worker.encoder_runner import EncoderRunner
from heteroserve.worker.load_memory import release_load_memory
from heteroserve.worker.model_runner import ModelRunner, StepResult, kv_cache_dtype
from heteroserve.worker.step_wire import StepDecoder, WireStep


@dataclass
class ModelInfo:
    """What the engine needs to know about the model, sent by rank 0 (the engine holds no weights)."""

    model_name: str
    tokenizer: object
    hf_config: object
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype  # the activations' or a 16-bit one (kv_cache_dtype="float16" / "bfloat16")
    max_model_len: int
    eos_token_id: int | None
    extra_eos_token_ids: list[int]
    sampling_defaults: dict[str, object]
    vocab_size: int
    kv_groups: list[KVGroupSpec]  # per KV group the fewest blocks any rank holds: every rank must fit them
    weight_bytes: int  # summed over the ranks
    model_folder: Path  # where the checkpoint (and a VL model's image processor config) lives
    vision_language: bool
    task: str  # "generate", or a pooling model's "embed" / "score"
    pooler_spec: PoolerSpec | None  # what a pooling model returns and accepts


class Worker:
    def __init__(
        self, config: EngineConfig, rank: int = 0, local_rank: int = 0, master_addr: str = "", master_port: int = 0
    ) -> None:
        parallel = config.parallel
        self.platform: Platform = resolve_platform(config.device.device)
        if parallel.world_size > 1:
            self.platform.bind_rank(local_rank)
        self.platform.configure_process()
        self.platform.manual_seed(config.model.seed)
        self.groups = ParallelGroups()
        if parallel.world_size > 1:
            self.groups = init_parallel_groups(
                rank,
                parallel.tensor_parallel_size,
                parallel.pipeline_parallel_size,
                self.platform.distributed_backend(),
                master_addr,
                master_port,
                self.platform.collectives_through_host,
            )
            self.groups = dataclasses.replace(self.groups, expert_parallel=parallel.enable_expert_parallel)
        sharded = self.groups if parallel.world_size > 1 else None
        loaded = load_model(config.model, self.platform, config.device.kernels, sharded)
        if parallel.enable_expert_parallel and sharded is None:  # on one rank the flag would otherwise do nothing
            if isinstance(loaded.model, EncoderModel):
                raise ValueError("--enable-expert-parallel: an encoder has no mixture-of-experts layers")
            check_tensor_parallel(loaded.model.arch, 1, expert_parallel=True)
        self.platform.assign_threads(loaded.dtype, config.device.kernels)
        self._decoder = StepDecoder()
        if isinstance(loaded.model, EncoderModel):
            release_load_memory()
            self.runner = EncoderRunner(loaded, self.platform, config.cache, config.scheduler)
            vocab_size = loaded.model.arch.vocab_size
        else:
            draft = None
            speculative = config.speculative
            if speculative is not None and speculative.method == "draft_model" and self.groups.samples:
                # Only the sampling rank drafts: the drafts reach every rank with the next step.
                draft_loaded = load_draft_model(config, loaded, self.platform)
                draft = DraftModel(
                    draft_loaded,
                    kv_cache_dtype(config.cache.kv_cache_dtype, draft_loaded.dtype),
                    speculative.num_speculative_tokens,
                    loaded.model.shard.full_arch.vocab_size,
                )
            release_load_memory()  # before the KV pool is sized from the memory left
            self.runner = model_runner_class(self.platform)(
                loaded,
                self.platform,
                config.cache,
                config.model.seed,
                config.lora,
                config.scheduler.max_num_batched_tokens,
                config.scheduler.max_num_seqs,
                config.device.enforce_eager,
                draft,
            )
            vocab_size = loaded.model.shard.full_arch.vocab_size
        kv_groups, weight_bytes = self._agree(self.runner.kv_groups, loaded.model.weight_bytes())
        self.info = ModelInfo(
            loaded.source.name,
            loaded.tokenizer,
            loaded.hf_config,
            loaded.dtype,
            self.runner.cache_dtype,
            loaded.max_model_len,
            loaded.eos_token_id,
            loaded.extra_eos_token_ids,
            loaded.sampling_defaults,
            vocab_size,
            kv_groups,
            weight_bytes,
            loaded.source.folder,
            loaded.vision is not None,
            loaded.task,
            loaded.pooler.spec if loaded.pooler is not None else None,
        )

    def _agree(self, kv_groups: list[KVGroupSpec], weight_bytes: int) -> tuple[list[KVGroupSpec], int]:
        """Per KV group the fewest blocks of any rank, and the weights' bytes summed over ranks."""
        if self.groups.world_size == 1:
            return kv_groups, weight_bytes
        blocks = torch.tensor([g.num_blocks for g in kv_groups])
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.groups.control_group)
        total = torch.tensor([weight_bytes])
        dist.all_reduce(total, group=self.groups.control_group)
        agreed = [KVGroupSpec(g.sliding_window, int(n)) for g, n in zip(kv_groups, blocks, strict=True)]
        return agreed, int(total)

    def execute(self, step: WireStep) -> dict[str, StepResult] | None:
        """Runs the step on this rank (its copies of the requests updated from the step's deltas); the sampling
        rank returns the results, the others None."""
        scheduled, released = self._decoder.decode(step)
        for request_id in released:
            self.runner.release(request_id)
        results = self.runner.execute(scheduled) if scheduled.scheduled else {}
        return results if self.groups.samples else None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def model_runner_class(platform: Platform) -> type[ModelRunner]:
    """ModelRunner, or the subclass the platform names in `model_runner_class`."""
    if platform.model_runner_class is None:
        return ModelRunner
    return load_class(platform.model_runner_class, ModelRunner)

"""Executes one scheduler step of an encoder (BERT, XLM-RoBERTa): flatten, forward, pool. No KV cache: every
request is computed whole in the step it is scheduled (bidirectional attention needs all of its tokens)."""

from __future__ import annotations

import torch

from heteroserve.config import CacheConfig, SchedulerConfig
from heteroserve.core.kv_cache_groups import KVGroupSpec
from heteroserve.core.scheduler import SchedulerOutput
from heteroserve.model.loader import LoadedModel
from heteroserve.platforms import Platform
from heteroserve.worker.model_runner import StepResult, pool_step


class EncoderRunner:
    def __init__(
        self, loaded: LoadedModel, platform: Platform, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ) -> None:
        self.model = loaded.model
        self.pooler = loaded.pooler
        self.device = platform.device
        self.dtype = loaded.dtype
        self.cache_dtype = loaded.dtype  # reported only: there is no cache
        # The scheduler's blocks are bookkeeping here, with no memory behind them: enough for max_num_seqs requests
        # of max_model_len, so only the token budget and max_num_seqs bound a step.
        blocks_per_request = -(-loaded.max_model_len // cache_config.block_size)
        self.num_blocks = cache_config.num_kv_blocks or scheduler_config.max_num_seqs * blocks_per_request
        self.kv_groups = [KVGroupSpec(None, self.num_blocks)]

    def release(self, request_id: str) -> None:
        """Nothing is kept per request between steps."""

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, StepResult]:
        items = output.scheduled
        input_ids: list[int] = []
        token_types: list[int] = []
        positions: list[int] = []
        for item in items:
            request = item.request
            input_ids.extend(request.prompt_token_ids)
            token_types.extend(request.token_type_ids or [0] * request.num_prompt_tokens)
            positions.extend(range(request.num_prompt_tokens))
        device = self.device
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(token_types, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            [item.num_new_tokens for item in items],
        )
        return pool_step(self.pooler, items, hidden)

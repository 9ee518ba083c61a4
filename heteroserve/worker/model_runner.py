"""Executes one scheduler step on the device: flatten, forward, LM head where needed, sample."""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from heteroserve.config import CacheConfig, LoRAConfig
from heteroserve.core.kv_cache_groups import KVGroupSpec
from heteroserve.core.scheduler import ScheduledRequest, SchedulerOutput
from heteroserve.lora.manager import LoRAManager
from heteroserve.model.layers.pooler import Pooler
from heteroserve.model.layers.sampler import Sampler, SamplingRow, logprobs_of
from heteroserve.model.loader import LoadedModel
from heteroserve.outputs import TokenLogprobs
from heteroserve.platforms import Platform
from heteroserve.platforms.attention import AttentionStep
from heteroserve.platforms.graph_capture import GraphCapture
from heteroserve.worker.decode_graphs import DecodeGraphs, StepRequest
from heteroserve.worker.draft_model import DraftModel
from heteroserve.worker.image_inputs import ImageInputs

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    token_ids: list[int] = field(default_factory=list)  # sampled: confirmed drafts, then the model's next token
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # one per token (None: not asked for)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # for tokens start+1 .. in order
    draft_token_ids: list[int] = field(default_factory=list)  # a draft model's proposals after token_ids
    pooled: torch.Tensor | None = None  # a pooling model's result: an embedding or scores (float32, CPU)


def kv_cache_dtype(name: str, activations: torch.dtype) -> torch.dtype:
    """The cache's dtype: the activations' ("auto"), or one no wider than them that the attention operators widen
    as they read (a 16-bit cache under float32 activations)."""
    if name == "auto":
        return activations
    dtype = getattr(torch, name)
    if dtype != activations and activations != torch.float32:
        raise ValueError(
            f"kv_cache_dtype={name} needs float32 activations or the same dtype, and the model runs in "
            f"{str(activations).removeprefix('torch.')}; use --kv-cache-dtype auto"
        )
    return dtype


def pool_step(pooler: Pooler, items: list[ScheduledRequest], hidden: torch.Tensor) -> dict[str, StepResult]:
    """Each request's pooled result from its rows of `hidden` (a pooling request's rows are its whole prompt, in
    the order of `items`)."""
    seq_lens = [item.num_new_tokens for item in items]
    pooled = pooler.pool(hidden, seq_lens, [item.request.pooling_params for item in items])
    return {item.request.request_id: StepResult(pooled=p) for item, p in zip(items, pooled, strict=True)}


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        platform: Platform,
        cache_config: CacheConfig,
        seed: int,
        lora_config: LoRAConfig | None,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enforce_eager: bool = False,
        draft: DraftModel | None = None,
    ) -> None:
        """max_num_batched_tokens: the scheduler's step budget, which a sliding window's KV group is sized by;
        max_num_seqs: the most requests running at once, which bounds what the KV cache can be asked to hold;
        enforce_eager: no graphs even where the platform has them; draft: speculative decoding's draft model,
        whose cache shares the full-attention blocks (and the budget)."""
        self.model = loaded.model
        self.draft = draft
        self.arch = loaded.model.arch
        self.platform = platform
        self.device = platform.device
        self.dtype = loaded.dtype
        self.cache_dtype = kv_cache_dtype(cache_config.kv_cache_dtype, loaded.dtype)
        self.block_size = cache_config.block_size
        self.stop_ids = [loaded.eos_token_id] if loaded.eos_token_id is not None else []
        # One KV group per window of the whole model, in its order (a pipeline stage may hold no layer of a group: its
        # cache for it is empty, and the engine's block tables still carry the group).
        self.windows = loaded.model.shard.full_arch.sliding_windows
        self.group_layers = [
            [i for i, spec in enumerate(self.arch.layers) if spec.sliding_window == window] for window in self.windows
        ]
        self.attn_backend = loaded.model.attn_backend  # lays out each layer's cache (kv_cache_shape)
        needs = self._blocks_per_request(loaded.max_model_len, max_num_batched_tokens)
        requests = None  # how many requests of max_model_len the budget holds
        if not cache_config.num_kv_blocks:
            request_bytes = self._request_bytes(needs)
            budget = platform.kv_cache_budget_bytes(
                cache_config.kv_cache_memory_bytes, cache_config.gpu_memory_utilization, max_num_seqs * request_bytes
            )
            logger.info(
                "KV cache: %.0f MiB, room for %.1f requests of max_model_len=%d at once (max_num_seqs=%d of them "
                "would take %.0f MiB)%s",
                budget / 2**20,
                budget / request_bytes,
                loaded.max_model_len,
                max_num_seqs,
                max_num_seqs * request_bytes / 2**20,
                "" if cache_config.kv_cache_memory_bytes is not None else "; --kv-cache-memory-bytes sets it",
            )
            requests = budget / request_bytes
        self.kv_groups = self._size_groups(requests, cache_config.num_kv_blocks, needs, loaded.max_model_len)
        self.num_blocks = self.kv_groups[0].num_blocks  # the full-attention layers' where the model has any
        capture = self._graph_capture(platform, enforce_eager, loaded)
        # Recorded decode graphs pad a step with rows that write to one block of each group past the pool's.
        spare = 0 if capture is None else 1
        # One tensor per group [its layers, 2, *the backend's layer shape]; layer i reads its slice. Where the values
        # are the keys' first dimensions (latent attention), one plane instead of 2, read as both.
        planes = 1 if self.arch.values_in_keys else 2
        self.kv_caches = [
            platform.allocate_kv_cache(
                (
                    len(layers),
                    planes,
                    *self.attn_backend.kv_cache_shape(
                        group.num_blocks + spare, self.block_size, self.arch.num_kv_heads, self.arch.head_dim
                    ),
                ),
                self.cache_dtype,
            )
            for layers, group in zip(self.group_layers, self.kv_groups, strict=True)
        ]
        self.kv_cache = self.kv_caches[0]  # likewise
        if draft is not None:
            draft.allocate(platform, self.kv_groups[0].num_blocks, self.block_size)
        self.layer_caches: list[tuple[torch.Tensor, torch.Tensor]] = [None] * self.arch.num_layers
        for layers, cache in zip(self.group_layers, self.kv_caches, strict=True):
            for j, i in enumerate(layers):
                self.layer_caches[i] = (cache[j, 0], cache[j, planes - 1])
        self.sampler = Sampler(self.model.ops.argmax_rows)
        self.pooler = loaded.pooler  # a decoder serving embeddings: pooled hidden states instead of tokens
        self.images = ImageInputs(loaded.vision, platform) if loaded.vision is not None else None
        self.lora = None
        if lora_config is not None:
            self.lora = LoRAManager(lora_config, self.model.shard, self.model.ops, self.dtype, self.device)
        self._seeds = random.Random(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._draft_generators: dict[str, torch.Generator] = {}  # the draft model's draws for sampled requests
        self.graphs = None
        if capture is not None:
            held = [g for g, layers in enumerate(self.group_layers) if layers]
            self.graphs = DecodeGraphs(
                capture,
                lambda ids, pos, meta: self.model(ids, pos, self.layer_caches, meta, None, None),
                self._attention_metadata,
                [self.windows[g] for g in held],
                [self.kv_groups[g].num_blocks for g in held],
                max_num_seqs,
                self.device,
            )

    def _graph_capture(self, platform: Platform, enforce_eager: bool, loaded: LoadedModel) -> GraphCapture | None:
        """The platform's graph API where decode steps are to be recorded and replayed (said in the log either way
        when the platform has one)."""
        capture = platform.graph_capture()
        if capture is None:
            return None
        why = None
        if enforce_eager:
            why = "--enforce-eager"
        elif self.model.parallel.world_size > 1:
            why = "recording collectives between ranks is not supported yet"
        elif loaded.pooler is not None:
            why = "a pooling model does not decode"
        elif any(layer.moe is not None and layer.moe.experts_on_host for layer in self.model.layers):
            why = "the routed experts run on the CPU (--moe-experts-device cpu)"
        if why is not None:
            logger.info("%s off: %s; every step runs eagerly", capture.name, why)
            return None
        logger.info("%s on: decode-only steps are recorded per batch size and replayed", capture.name)
        return capture

    def _attention_metadata(self, window: int | None, requests: list[StepRequest], num_decodes: int) -> Any:
        """The attention backend's metadata of a step's requests for the KV group of `window`."""
        step = AttentionStep.of(self.block_size, requests, num_decodes, window, self.device)
        return self.attn_backend.build_metadata(step)

    def bytes_per_block(self, num_layers: int | None = None) -> int:
        """Bytes of one block of `num_layers` layers (all of them by default)."""
        a = self.arch
        layers = a.num_layers if num_layers is None else num_layers
        planes = 1 if a.values_in_keys else 2
        block = math.prod(self.attn_backend.kv_cache_shape(1, self.block_size, a.num_kv_heads, a.head_dim))
        return planes * layers * block * self.cache_dtype.itemsize

    def _blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> list[int]:
        """Blocks one request of max_model_len takes in each KV group: a window's group only what its window and
        one step's tokens need (min(max_model_len, window - 1 + max_num_batched_tokens) tokens and a block)."""
        bs = self.block_size
        return [
            -(-max_model_len // bs)
            if w is None
            else min(-(-max_model_len // bs), -(-(w - 1 + max_num_batched_tokens) // bs) + 1)
            for w in self.windows
        ]

    def _request_bytes(self, needs: list[int]) -> int:
        """Bytes one request of max_model_len takes over every group (and in the draft model's cache)."""
        total = sum(n * self.bytes_per_block(len(layers)) for n, layers in zip(needs, self.group_layers, strict=True))
        return total + (needs[0] * self.draft.bytes_per_block(self.block_size) if self.draft is not None else 0)

    def _size_groups(
        self, requests: float | None, num_kv_blocks: int | None, needs: list[int], max_model_len: int
    ) -> list[KVGroupSpec]:
        """Blocks per KV group: `num_kv_blocks` each where given; otherwise the budget's share, so that every group
        holds the same number of `requests` at max_model_len (`needs`: one request's blocks in each group)."""
        bs = self.block_size
        counts = [num_kv_blocks] * len(self.windows) if num_kv_blocks else [int(requests * n) for n in needs]
        for window, count, need in zip(self.windows, counts, needs, strict=True):
            if count < need:
                group = ""
                if len(self.windows) > 1:
                    group = (
                        " for the full-attention layers"
                        if window is None
                        else f" for the layers with a {window}-token window"
                    )
                window_need = "" if window is None else f" (its window and a step: {need} blocks)"
                raise ValueError(
                    f"the KV cache holds {count} blocks of {bs} tokens{group}, fewer than one request of "
                    f"max_model_len={max_model_len}{window_need}; raise --kv-cache-memory-bytes "
                    "(kv_cache_memory_bytes) or lower --max-model-len (max_model_len)"
                )
        return [KVGroupSpec(w, n) for w, n in zip(self.windows, counts, strict=True)]

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._draft_generators.pop(request_id, None)
        if self.draft is not None:
            self.draft.distributions.pop(request_id, None)
        if self.images is not None:
            self.images.release(request_id)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, StepResult]:
        # Decode rows first (a step of only those runs the fused decode layer, drafts included); with LoRA, each
        # group's rows ordered by adapter slot, base model first, so an adapter's rows sit together.
        slot_of: dict[int, int] = {}
        if self.lora is not None:
            adapters = {s.request.lora_id: s.request.lora_request for s in output.scheduled if s.request.lora_id}
            slot_of = self.lora.activate(list(adapters.values()))
        items = sorted(output.scheduled, key=lambda s: (not s.decode_rows, slot_of.get(s.request.lora_id, -1)))
        input_ids: list[int] = []
        positions: list[int] = []
        for item in items:
            input_ids.extend(item.input_token_ids)
            positions.extend(range(item.start, item.start + item.num_new_tokens))
        num_decodes = sum(1 for item in items if item.decode_rows)
        with_images = self.images is not None and any(item.request.multimodal is not None for item in items)
        # Each held KV group's part of the step (a pipeline stage may hold none of a group's layers).
        requests = {
            window: [(item.block_ids[g], item.start, item.num_new_tokens) for item in items]
            for g, window in enumerate(self.windows)
            if self.group_layers[g]
        }
        hidden = None
        if self.graphs is not None and num_decodes == len(items) and not slot_of and not with_images:
            hidden = self.graphs.run(list(requests.values()), input_ids, positions)
        if hidden is None:
            meta = {window: self._attention_metadata(window, group, num_decodes) for window, group in requests.items()}
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            injected = None
            if with_images:
                pos, injected = self.images.prepare(items)  # M-RoPE positions; text-only batches skip this
            else:
                pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            lora = None
            if slot_of:
                lora = self.lora.batch_for([(slot_of.get(item.request.lora_id), item.num_new_tokens) for item in items])
            hidden = self.model(ids, pos, self.layer_caches, meta, injected, lora)
        if not self.model.parallel.is_last_stage:  # the next pipeline stage carries on
            return {}
        if self.pooler is not None:
            return pool_step(self.pooler, items, hidden)
        results = self._sample(items, hidden, output)
        if self.draft is not None:
            sampled = {rid: result.token_ids for rid, result in results.items()}
            for rid, drafts in self.draft.propose(items, sampled, self.sampler, self._draft_sampling_row).items():
                results[rid].draft_token_ids = drafts
        return results

    def _sample(
        self, items: list[ScheduledRequest], hidden: torch.Tensor, output: SchedulerOutput
    ) -> dict[str, StepResult]:
        rows: list[int] = []  # hidden rows that go through the LM head
        sample_rows: list[tuple[ScheduledRequest, int, int]] = []  # (item, row, drafts before it)
        prompt_rows: list[tuple[ScheduledRequest, int, int]] = []  # (item, first row, count)
        offset = 0
        for item in items:
            request, start, n = item.request, item.start, item.num_new_tokens
            if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                count = min(start + n, request.num_prompt_tokens - 1) - start
                prompt_rows.append((item, len(rows), count))
                rows.extend(range(offset, offset + count))
            if item.samples:  # the last known token's row, then one row per draft
                drafts = len(item.draft_token_ids)
                for j in range(drafts + 1):
                    sample_rows.append((item, len(rows), j))
                    rows.append(offset + n - 1 - drafts + j)
            offset += n
        results = {item.request.request_id: StepResult() for item in items}
        if not rows:
            return results
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        if logits is None:  # a tensor-parallel rank that does not sample
            return results
        if sample_rows:
            # Prompt-logprob rows sit between the sampled ones; without them every row samples (no copy).
            sampled = (
                logits[torch.tensor([r for _, r, _ in sample_rows], device=self.device)] if prompt_rows else logits
            )
            sampling = [self._sampling_row(item, j, output) for item, _, j in sample_rows]
            # A sampled request's drafts are checked by speculative sampling over its rows together; a greedy
            # request's rows are sampled with everything else, each draft confirmed when it is the model's choice.
            verified = [
                i
                for i, (item, _, j) in enumerate(sample_rows)
                if item.draft_token_ids and not item.request.sampling_params.greedy
            ]
            plain = sorted(set(range(len(sample_rows))) - set(verified))
            if plain:
                rows_logits = sampled if not verified else sampled[torch.tensor(plain, device=self.device)]
                tokens, logprobs = self.sampler(rows_logits, [sampling[i] for i in plain])
                for i, token, entry in zip(plain, tokens, logprobs, strict=True):
                    item, _, j = sample_rows[i]
                    result = results[item.request.request_id]
                    if len(result.token_ids) == j and (j == 0 or result.token_ids[-1] == item.draft_token_ids[j - 1]):
                        result.token_ids.append(token)  # draft j-1 was confirmed, so this row's prediction counts
                        result.logprobs.append(entry)
            for i in verified:
                item, _, j = sample_rows[i]
                if j == 0:
                    span = slice(i, i + len(item.draft_token_ids) + 1)
                    result = results[item.request.request_id]
                    result.token_ids, result.logprobs = self.sampler.verify_drafts(
                        sampled[span], sampling[span], item.draft_token_ids, self._draft_distribution(item)
                    )
        for item, first, count in prompt_rows:
            request = item.request
            targets = torch.tensor(request.token_ids[item.start + 1 : item.start + 1 + count], device=self.device)
            lp = torch.log_softmax(logits[first : first + count], dim=-1)
            results[request.request_id].prompt_logprobs = logprobs_of(
                lp, targets, request.sampling_params.prompt_logprobs
            )
        return results

    def _draft_distribution(self, item: ScheduledRequest) -> torch.Tensor | None:
        """The distributions a sampled request's drafts were drawn from (None: the n-gram proposer's drafts)."""
        if self.draft is None:
            return None
        drafts, probs = self.draft.distributions.pop(item.request.request_id)
        if drafts[: len(item.draft_token_ids)] != item.draft_token_ids:
            raise RuntimeError(f"request {item.request.request_id}: its drafts are not the ones the draft model drew")
        return probs[: len(item.draft_token_ids)]

    def _draft_sampling_row(self, item: ScheduledRequest, tokens: list[int]) -> SamplingRow:
        """The draft model's view of a sampled request after its known tokens and `tokens` (this step's sampled
        ones and the drafts so far): the request's rules, drawn with a generator of the draft's own."""
        request = item.request
        params = request.sampling_params
        generator = self._draft_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(self.device)
            seed = params.seed + 1 if params.seed is not None else self._seeds.getrandbits(63)
            generator.manual_seed(seed)
            self._draft_generators[request.request_id] = generator
        stop_ids = params.stop_token_ids + ([] if params.ignore_eos else self.stop_ids)
        return SamplingRow(params, request.token_ids + tokens, request.num_prompt_tokens, stop_ids, generator)

    def _sampling_row(self, item: ScheduledRequest, drafts_before: int, output: SchedulerOutput) -> SamplingRow:
        """The sampler's view of the request at the row after its known tokens and `drafts_before` drafts
        (penalties and min_tokens see the drafts as if they had been sampled)."""
        request = item.request
        params = request.sampling_params
        generator = None
        if not params.greedy:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = torch.Generator(self.device)
                generator.manual_seed(params.seed if params.seed is not None else self._seeds.getrandbits(63))
                self._generators[request.request_id] = generator
        stop_ids = params.stop_token_ids + ([] if params.ignore_eos else self.stop_ids)
        token_ids = request.token_ids + item.draft_token_ids[:drafts_before] if drafts_before else request.token_ids
        bitmask = output.bitmask_of(request.request_id)  # requests under a grammar take no drafts: row 0
        if bitmask is not None:
            bitmask = torch.as_tensor(bitmask, dtype=torch.int32)
        return SamplingRow(params, token_ids, request.num_prompt_tokens, stop_ids, generator, bitmask)

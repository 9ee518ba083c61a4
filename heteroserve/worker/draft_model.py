"""The draft model of speculative decoding: a smaller model with the served one's tokenizer, or the served
checkpoint's own 4-bit copy, proposing each request's next tokens for the served model to check.

Its KV cache lives on the served model's block ids: every block of the pool has a slot in both caches, so the
scheduler's block tables, prefix cache and preemption serve both, and the pool is sized by their bytes together.
In each step it first runs over the step's tokens as the served model did (so its cache holds every token the
served model's does, prompts and prefix-cached blocks included), then drafts: from each drafting request's newest
token, k tokens (greedy, or drawn as the request samples) in k batched decode passes, each writing its input's
keys into the request's lookahead slots (allocated by the scheduler past the step's tokens). The keys of drafts
the served model rejects are written over by a later step, as the served model's are.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from heteroserve.config import SELF_INT4, EngineConfig, ModelConfig
from heteroserve.core.scheduler import ScheduledRequest, Scheduler
from heteroserve.model.decoder import DecoderModel
from heteroserve.model.layers.sampler import Sampler, SamplingRow
from heteroserve.model.loader import LoadedModel, load_model
from heteroserve.platforms import Platform
from heteroserve.platforms.attention import AttentionStep

logger = logging.getLogger(__name__)


def load_draft_model(config: EngineConfig, target: LoadedModel, platform: Platform) -> LoadedModel:
    """The draft model `config.speculative` names, checked against the served model `target`."""
    spec = config.speculative
    served = config.model
    if spec.model == SELF_INT4:
        if target.source.gguf_file is not None and served.quantization != "none":
            raise ValueError(
                "speculative model self-int4 drafts a float model with its 4-bit copy, and this GGUF model already "
                "runs from its quantised blocks; serve it with --quantization none, or name a draft model"
            )
        if served.quantization not in (None, "none") or getattr(target.hf_config, "quantization_config", None):
            raise ValueError(
                "speculative model self-int4 drafts a float model with its 4-bit copy, and this model already "
                f"runs quantised ({served.quantization or target.hf_config.quantization_config.get('quant_method')})"
            )
        # A GGUF file's own blocks are its 4-bit copy; a float folder is quantised to int4 as it loads.
        draft_config = dataclasses.replace(
            served, quantization=None if target.source.gguf_file is not None else "int4", runner="generate"
        )
    else:
        draft_config = ModelConfig(
            model=spec.model,
            dtype=served.dtype,
            seed=served.seed,
            quantization=spec.quantization,
            runner="generate",
        )
    draft = load_model(draft_config, platform, config.device.kernels)
    _check_draft(draft, target, spec.model)
    logger.info(
        "speculative decoding: draft model %s (%.0f MiB of weights beside the model's %.0f MiB), %d tokens a step; "
        "requests under a grammar decode a token a step",
        spec.model,
        draft.model.weight_bytes() / 2**20,
        target.model.weight_bytes() / 2**20,
        spec.num_speculative_tokens,
    )
    if draft.max_model_len < target.max_model_len:
        logger.warning(
            "the draft model's context (%d tokens) is shorter than max_model_len=%d: longer requests decode "
            "without drafts past it",
            draft.max_model_len,
            target.max_model_len,
        )
    return draft


def _check_draft(draft: LoadedModel, target: LoadedModel, name: str) -> None:
    """Refuses a draft whose tokens would not mean the served model's, or whose cache the pool cannot carry."""
    if not isinstance(draft.model, DecoderModel) or draft.pooler is not None:
        raise ValueError(f"speculative draft model {name}: a generating decoder is needed, not a {draft.task} model")
    if target.vision is not None or draft.vision is not None:
        raise ValueError("speculative decoding with a draft model: vision-language models are not supported")
    if target.model.shard.full_arch.sliding_windows[0] is not None or draft.model.arch.sliding_windows != [None]:
        raise ValueError(
            "speculative decoding with a draft model: both models must have full-attention layers and the draft no "
            "sliding-window ones (the draft's cache lives on the full-attention blocks)"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        ours, theirs = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
        if ours != theirs:
            differing = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[0]
            raise ValueError(
                f"speculative draft model {name} has another tokenizer than the served model (first difference: "
                f"token {differing[0]!r} as id {differing[1]}); drafts must be the served model's token ids"
            )
    elif draft.model.arch.vocab_size != target.model.shard.full_arch.vocab_size:
        raise ValueError(
            f"speculative draft model {name} has {draft.model.arch.vocab_size} tokens and the served model "
            f"{target.model.shard.full_arch.vocab_size}; drafts must be the served model's token ids"
        )


class DraftModel:
    """A loaded draft model with its KV cache on the served model's full-attention block ids."""

    def __init__(
        self, loaded: LoadedModel, cache_dtype: torch.dtype, num_speculative_tokens: int, vocab_size: int
    ) -> None:
        """cache_dtype: its KV cache's; vocab_size: the served model's, the width its drafts' logits are given
        (cut where the draft's vocabulary is wider, -inf for the ids it lacks), so that a request's token rules
        (logit_bias, allowed ids) index them as the served model's and every draft is an id of both."""
        self.model: DecoderModel = loaded.model
        self.arch = self.model.arch
        self.backend = self.model.attn_backend
        self.cache_dtype = cache_dtype
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = loaded.max_model_len
        self.vocab_size = vocab_size
        self.layer_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # set by allocate
        self.block_size = 0
        self.device = torch.device("cpu")
        # A sampled request's latest drafts and the distributions [drafts, vocab] they were drawn from.
        self.distributions: dict[str, tuple[list[int], torch.Tensor]] = {}

    @property
    def planes(self) -> int:
        """2 (keys and values), or 1 where the values are the keys' first dimensions (latent attention)."""
        return 1 if self.arch.values_in_keys else 2

    def bytes_per_block(self, block_size: int) -> int:
        shape = self.backend.kv_cache_shape(1, block_size, self.arch.num_kv_heads, self.arch.head_dim)
        return self.planes * self.arch.num_layers * math.prod(shape) * self.cache_dtype.itemsize

    def allocate(self, platform: Platform, num_blocks: int, block_size: int) -> None:
        """Its cache: `num_blocks` blocks (the served model's full-attention pool) of every layer."""
        a = self.arch
        shape = self.backend.kv_cache_shape(num_blocks, block_size, a.num_kv_heads, a.head_dim)
        cache = platform.allocate_kv_cache((a.num_layers, self.planes, *shape), self.cache_dtype)
        self.layer_caches = [(cache[i, 0], cache[i, self.planes - 1]) for i in range(a.num_layers)]
        self.block_size = block_size
        self.device = platform.device

    def _forward(self, requests: list[tuple[list[int], int, int]], num_decodes: int, ids, positions) -> torch.Tensor:
        step = AttentionStep.of(self.block_size, requests, num_decodes, None, self.device)
        meta = {None: self.backend.build_metadata(step)}
        # An id the draft has no row for (the served model's padding of the same tokenizer) reaches it as id 0:
        # the drafts after it are then rarely kept, and never change a token.
        ids = torch.tensor([t if t < self.arch.vocab_size else 0 for t in ids], dtype=torch.long, device=self.device)
        positions = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.model(ids, positions, self.layer_caches, meta, None, None)

    def propose(
        self,
        items: list[ScheduledRequest],
        sampled: dict[str, list[int]],
        sampler: Sampler,
        sampling_row: Callable[[ScheduledRequest, list[int]], SamplingRow],
    ) -> dict[str, list[int]]:
        """Drafts after each drafting request's `sampled` tokens (request id -> drafts), its cache brought up to
        the step's tokens on the way. A greedy request's drafts are the draft's greedy tokens; a sampled one's are
        drawn by `sampler` under the request's rules (`sampling_row(item, tokens after its known ones)`), and the
        distributions they were drawn from are kept in `distributions` for the served model's check.

        A request's drafts in this step are the ones this model wrote the keys of in the previous step (all but
        the last), so only the tokens whose keys it lacks are computed: a prompt chunk or a plain decode whole, of
        a step with drafts only the last draft and only where every draft was confirmed. The first pass computes
        those and each drafting request's newest token, whose row gives its first draft; each further pass is one
        token a drafting request."""
        rows: list[_DraftRow] = []
        for item in items:
            tokens = sampled.get(item.request.request_id, [])
            drafts = item.draft_token_ids
            if drafts:
                accepted = len(tokens) - 1
                first = item.start + accepted + 1 if accepted < len(drafts) else item.start + len(drafts)
                missing = [drafts[-1]] if accepted == len(drafts) else []
            else:
                first, missing = item.start, item.input_token_ids
            newest = first + len(missing)  # where the newest sampled token goes
            room = min(len(item.block_ids[0]) * self.block_size, self.max_model_len) - newest
            count = min(self.num_speculative_tokens, room) if tokens and Scheduler.may_draft(item.request) else 0
            if count > 0:
                missing = [*missing, tokens[-1]]
            if missing:
                decode = item.decode_rows and len(missing) <= 2
                rows.append(_DraftRow(item, item.block_ids[0], first, missing, count, decode))
        if not rows:
            return {}
        rows.sort(key=lambda row: not row.decode)
        ids = [token for row in rows for token in row.tokens]
        positions = [p for row in rows for p in range(row.first, row.first + len(row.tokens))]
        requests = [(row.block_ids, row.first, len(row.tokens)) for row in rows]
        hidden = self._forward(requests, sum(row.decode for row in rows), ids, positions)
        ends = list(itertools.accumulate(len(row.tokens) for row in rows))
        drafting = [(row, end - 1) for row, end in zip(rows, ends, strict=True) if row.count]
        drafts: dict[str, list[int]] = {row.request_id: [] for row, _ in drafting}
        distributions: dict[str, list[torch.Tensor]] = {}
        for j in range(max((row.count for row, _ in drafting), default=0)):
            active = [row for row, _ in drafting if row.count > j]
            if j:
                newest = [row.first + len(row.tokens) - 1 + j for row in active]
                ids = [drafts[row.request_id][-1] for row in active]
                requests = [(row.block_ids, position, 1) for row, position in zip(active, newest, strict=True)]
                hidden = self._forward(requests, len(active), ids, newest)
            else:
                hidden = hidden[torch.tensor([end for _, end in drafting], device=self.device)]
            logits = self._served_width(self.model.compute_logits(hidden))
            tokens = self.model.ops.argmax_rows(logits).tolist()
            drawn = [i for i, row in enumerate(active) if row.sampling]
            if drawn:
                rows_of = [
                    sampling_row(active[i].item, sampled[active[i].request_id] + drafts[active[i].request_id])
                    for i in drawn
                ]
                chosen, probs = sampler.draw_with_distribution(logits[torch.tensor(drawn, device=self.device)], rows_of)
                for i, token, line in zip(drawn, chosen, probs, strict=True):
                    tokens[i] = token
                    distributions.setdefault(active[i].request_id, []).append(line)
            for row, token in zip(active, tokens, strict=True):
                drafts[row.request_id].append(token)
        for request_id, lines in distributions.items():
            self.distributions[request_id] = (drafts[request_id], torch.stack(lines))
        return drafts

    def _served_width(self, logits: torch.Tensor) -> torch.Tensor:
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[:, : self.vocab_size].contiguous()
        if width < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return logits


@dataclass
class _DraftRow:
    """A request's part of the draft model's first pass."""

    item: ScheduledRequest
    block_ids: list[int]
    first: int  # the position of its first token
    tokens: list[int]  # the tokens whose keys the cache lacks, then (when drafting) its newest sampled token
    count: int  # drafts it has room for (0: not drafting)
    decode: bool  # laid out as decode rows

    @property
    def request_id(self) -> str:
        return self.item.request.request_id

    @property
    def sampling(self) -> bool:
        """Whether its drafts are drawn (a sampled request) rather than the draft's greedy choice."""
        return not self.item.request.sampling_params.greedy

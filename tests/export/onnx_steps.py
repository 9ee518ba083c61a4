"""Generation through exported graphs with onnxruntime, the KV cache laid out by our own block manager.

A batch of prompts is prefilled in one call of the prefill graph (the shorter prompts padded with rows that write
nothing), then every sequence decodes one token per call of the decode graph. `KVCacheManager` allocates each
sequence's blocks as it grows, exactly as the engine's scheduler asks it to, so block tables and slot mappings are
the engine's (blocks handed out in pool order, not contiguous per sequence once sequences interleave).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from heteroserve.core.kv_cache_manager import KVCacheManager
from heteroserve.core.request import Request
from heteroserve.export.onnx_runner import OnnxDecoder
from heteroserve.sampling_params import SamplingParams


@dataclass
class OnnxRun:
    prompts: list[list[int]]
    tokens: list[list[int]] = field(default_factory=list)  # greedy tokens per sequence
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # [len(prompt), vocab] per sequence
    step_logits: list[list[torch.Tensor]] = field(default_factory=list)  # the logits that chose each token

    def margins(self) -> list[float]:
        """Top-2 logit gap of every greedy choice."""
        return [float(row.topk(2).values.diff().abs()) for rows in self.step_logits for row in rows]


def _slots(manager: KVCacheManager, request: Request, start: int, count: int) -> list[int]:
    ids = manager.block_ids(request.request_id)
    size = manager.block_size
    return [ids[p // size] * size + p % size for p in range(start, start + count)]


def generate(decoder: OnnxDecoder, prompts: list[list[int]], new_tokens: int, num_blocks: int = 64) -> OnnxRun:
    """Greedy generation of `new_tokens` per prompt: one prefill call, then `new_tokens - 1` decode calls."""
    paged = decoder.paged
    manager = KVCacheManager(num_blocks, decoder.config["block_size"] or 1, enable_prefix_caching=False)
    requests = [Request(f"r{i}", list(p), SamplingParams(max_tokens=new_tokens)) for i, p in enumerate(prompts)]
    caches = decoder.new_caches(num_blocks=num_blocks, batch=len(prompts))
    run = OnnxRun(prompts, [[] for _ in prompts], [], [[] for _ in prompts])
    b, s = len(prompts), max(len(p) for p in prompts)
    ids, positions = np.zeros((b, s), np.int64), np.full((b, s), 0 if paged else -1, np.int64)
    slots = np.full((b, s), -1, np.int64)
    for i, (request, prompt) in enumerate(zip(requests, prompts, strict=True)):
        assert manager.allocate_slots(request, len(prompt))
        ids[i, : len(prompt)] = prompt
        positions[i, : len(prompt)] = np.arange(len(prompt))
        slots[i, : len(prompt)] = _slots(manager, request, 0, len(prompt))
        request.num_computed_tokens = len(prompt)
    seq_lens = np.array([len(p) for p in prompts], np.int64)
    logits, caches = decoder.run(
        "prefill", ids, positions, seq_lens, caches, *_paged(decoder, manager, requests, slots)
    )
    last = []
    for i, prompt in enumerate(prompts):
        rows = torch.from_numpy(logits[i, : len(prompt)].copy())
        run.prompt_logits.append(rows)
        last.append(rows[-1])
    for step in range(new_tokens):
        for i, row in enumerate(last):
            run.step_logits[i].append(row)
            run.tokens[i].append(int(row.argmax()))
        if step == new_tokens - 1:
            break
        ids = np.array([[tokens[-1]] for tokens in run.tokens], np.int64)
        positions = np.array([[r.num_computed_tokens] for r in requests], np.int64)
        for request in requests:
            assert manager.allocate_slots(request, 1)
        slots = np.array([_slots(manager, r, r.num_computed_tokens, 1) for r in requests], np.int64)
        for request in requests:
            request.num_computed_tokens += 1
        seq_lens = np.array([r.num_computed_tokens for r in requests], np.int64)
        logits, caches = decoder.run(
            "decode", ids, positions, seq_lens, caches, *_paged(decoder, manager, requests, slots)
        )
        last = [torch.from_numpy(logits[i, 0].copy()) for i in range(b)]
    return run


def _paged(decoder: OnnxDecoder, manager: KVCacheManager, requests: list[Request], slots: np.ndarray) -> tuple:
    """(slot_mapping, block_tables) for the paged layout, nothing for the contiguous one."""
    if not decoder.paged:
        return ()
    tables = [manager.block_ids(r.request_id) for r in requests]
    width = max(len(t) for t in tables)
    return slots, np.array([t + [0] * (width - len(t)) for t in tables], np.int64)

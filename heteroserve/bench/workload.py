"""The shared benchmark workload (WORKLOAD.md), carried in the package since users have no shared/ folder.

Request i is the text "Request {i}: " followed by 40 of the sentences below, cycling from sentence i,
cut to exactly P tokens with the model's own tokenizer (no chat template).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Large language models generate text one token at a time.",
    "Paged attention stores the key value cache in fixed size blocks.",
    "Continuous batching lets new requests join a running batch.",
    "The capital of France is Paris and the capital of China is Beijing.",
    "Domestic accelerators need a portable inference engine.",
    "Prefix caching reuses the blocks of a shared system prompt.",
    "Quantized weights cut memory traffic during decoding.",
]
SENTENCES_PER_PROMPT = 40

Encode = Callable[[str], list[int]]


def prompt_text(i: int) -> str:
    return f"Request {i}: " + " ".join(SENTENCES[(i + k) % len(SENTENCES)] for k in range(SENTENCES_PER_PROMPT))


def prompt_ids(encode: Encode, i: int, length: int) -> list[int]:
    ids = encode(prompt_text(i))
    if len(ids) < length:
        raise ValueError(f"request {i}: the workload text has only {len(ids)} tokens, fewer than P={length}")
    return ids[:length]


def fingerprint(prompts: list[list[int]]) -> str:
    """Short hash over the prompt ids; WORKLOAD.md gives 30904d512771824f for 64 prompts of P=128."""
    digest = hashlib.sha256()
    for ids in prompts:
        digest.update((",".join(map(str, ids)) + ";").encode())
    return digest.hexdigest()[:16]


def scenario_requests(
    encode: Encode,
    scenario: str,
    num_requests: int,
    prompt_len: int,
    output_len: int,
) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request. Scenario D: P = 32 + (37 i mod 353), G = 16 + (53 i mod 241)."""
    if scenario == "D":
        return [(prompt_ids(encode, i, 32 + (37 * i) % 353), 16 + (53 * i) % 241) for i in range(num_requests)]
    return [(prompt_ids(encode, i, prompt_len), output_len) for i in range(num_requests)]


def random_requests(
    vocab_size: int,
    num_requests: int,
    prompt_len: int,
    output_len: int,
    seed: int,
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(vocab_size) for _ in range(prompt_len)], output_len) for _ in range(num_requests)]


def jsonl_requests(path: str, encode: Encode, output_len: int) -> list[tuple[list[int], int]]:
    """One request per line: {"prompt": text} or {"prompt_token_ids": [...]}, optionally "max_tokens"."""
    import json

    requests = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt_token_ids" in row:
                ids = [int(t) for t in row["prompt_token_ids"]]
            elif "prompt" in row:
                ids = encode(row["prompt"])
            else:
                raise ValueError(f"{path}:{number}: a line needs 'prompt' or 'prompt_token_ids'")
            requests.append((ids, int(row.get("max_tokens", output_len))))
    if not requests:
        raise ValueError(f"{path} has no requests")
    return requests

"""Draft-model speculation on a chat transcript: acceptance and decode speed where the answer does not copy the
prompt, the case n-gram drafts cannot help.

The transcript is a user's conversation of several turns (questions, a rewrite, code, a translation, a summary),
each turn sent with the conversation so far through the chat template, one request at a time as a chat user
sends them, the model's own replies kept in the history. Each round runs it in two processes, alternating which
goes first: the default model dequantised to float32 alone, and drafted by its own 4-bit copy (`"model":
"self-int4"`). Decode speed is the tokens after the first over the time after the first token, summed over the
turns; the acceptance is the engine's own count. At temperature 0 the two sides' replies must be the same tokens
(checked); at --temperature > 0 each side samples with the same seeds, and only acceptance and speed are compared.

    python bench/draft_chat.py --rounds 3 --num-speculative-tokens 4 --out result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

TURNS = [
    "What is the difference between a bank's capital adequacy ratio and its liquidity coverage ratio?",
    "Explain that again for a customer who has never studied finance, in three short paragraphs.",
    "Write a Python function that checks whether a string is a valid IPv4 address, with a docstring.",
    "Now add tests for it using pytest, including edge cases.",
    "Translate this sentence into French: The power plant will be offline for maintenance next Tuesday.",
    "Give me five ideas for reducing electricity consumption in an office building.",
    "Summarise our conversation so far in four bullet points.",
    "What are the main risks of running a large language model on-premises instead of in the cloud?",
]


def run_side(speculative: str | None, temperature: float, max_tokens: int) -> dict:
    """One process's pass over the transcript (called with --side)."""
    from heteroserve import LLM, SamplingParams

    kwargs = {"quantization": "none", "enable_prefix_caching": False}
    if speculative:
        kwargs["speculative_config"] = json.loads(speculative)
    llm = LLM(None, **kwargs)
    llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    stats_before = llm.engine.stats()
    history: list[dict] = []
    replies, decode_tokens, decode_seconds = [], 0, 0.0
    for turn, question in enumerate(TURNS):
        history.append({"role": "user", "content": question})
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=turn)
        output = llm.chat(history, params, use_tqdm=False)[0]
        completion, metrics = output.outputs[0], output.metrics
        replies.append(completion.token_ids)
        history.append({"role": "assistant", "content": completion.text})
        decode_tokens += len(completion.token_ids) - 1
        decode_seconds += metrics.finished_time - metrics.first_token_time
    stats = llm.engine.stats()
    drafts = stats.spec_draft_tokens - stats_before.spec_draft_tokens
    accepted = stats.spec_accepted_tokens - stats_before.spec_accepted_tokens
    return {
        "decode_tokens_per_s": decode_tokens / decode_seconds,
        "generated_tokens": sum(len(r) for r in replies),
        "acceptance": accepted / drafts if drafts else None,
        "replies": replies,
    }


def side_process(speculative: str | None, temperature: float, max_tokens: int) -> dict:
    command = [sys.executable, __file__, "--side", speculative or "", "--temperature", str(temperature)]
    command += ["--max-tokens", str(max_tokens)]
    run = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--draft", default="self-int4", help='the draft checkpoint, or "self-int4"')
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--side", help=argparse.SUPPRESS)  # a child process: "" plain, else the speculative config
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(run_side(args.side or None, args.temperature, args.max_tokens)))
        return
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.num_speculative_tokens}
    sides = {"plain": None, "speculative": json.dumps(spec)}
    rounds = []
    for index in range(args.rounds):
        order = list(sides) if index % 2 == 0 else list(reversed(sides))
        result = {side: side_process(sides[side], args.temperature, args.max_tokens) for side in order}
        plain, fast = result["plain"], result["speculative"]
        same = plain["replies"] == fast["replies"]
        if args.temperature == 0 and not same:
            raise SystemExit("greedy replies differ between the plain and the speculative run")
        ratio = fast["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        rounds.append(
            {**{s: {k: v for k, v in r.items() if k != "replies"} for s, r in result.items()}, "ratio": ratio}
        )
        print(
            f"round {index + 1} ({' then '.join(order)}): plain {plain['decode_tokens_per_s']:.1f} tok/s, "
            f"speculative {fast['decode_tokens_per_s']:.1f} tok/s -> {ratio:.2f}x, acceptance "
            f"{fast['acceptance']:.3f}, {fast['generated_tokens']} tokens, replies identical: {same}",
            flush=True,
        )
    ratios = [r["ratio"] for r in rounds]
    print(f"speculative / plain decode on the transcript: median {statistics.median(ratios):.2f}x")
    if args.out:
        summary = {"speculative_config": spec, "temperature": args.temperature, "max_tokens": args.max_tokens}
        summary.update(turns=TURNS, rounds=rounds, median_decode_ratio=statistics.median(ratios))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()

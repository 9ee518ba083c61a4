"""Sampling on the default model, checked against transformers' logits and its own logits processors."""

from __future__ import annotations

import math

import pytest
import torch

from heteroserve import LLM, SamplingParams

PROMPT = "Write a short poem about the sea:"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256, kv_cache_memory_bytes=64 * 1024**2, seed=1, quantization="none")


@pytest.fixture(scope="module")
def prompt_ids(default_tokenizer) -> list[int]:
    return default_tokenizer.encode(PROMPT)


def _run(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_seeded_sampling_reproduces_whatever_the_batch(llm, prompt_ids, default_tokenizer):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20)
    alone = _run(llm, [prompt_ids], params)[0].outputs[0].token_ids
    neighbours = [default_tokenizer.encode(f"Neighbour request {i} talks about something else") for i in range(5)]
    mixed = _run(
        llm,
        [*neighbours[:2], prompt_ids, *neighbours[2:]],
        [SamplingParams(temperature=1.0, max_tokens=30)] * 2
        + [params]
        + [SamplingParams(temperature=0.7, max_tokens=10)] * 3,
    )
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = _run(llm, [prompt_ids], params.clone(seed=99))[0].outputs[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(llm, prompt_ids):
    greedy = _run(llm, [prompt_ids], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    top1 = (
        _run(llm, [prompt_ids], SamplingParams(temperature=1.5, top_k=1, max_tokens=16, seed=5))[0].outputs[0].token_ids
    )
    assert top1 == greedy


def test_sampling_follows_the_distribution(llm, prompt_ids, hf_default):
    """First-token frequencies over many seeds track transformers' softmax(logits / T)."""
    temperature, n = 1.0, 300
    outputs = _run(llm, [prompt_ids], SamplingParams(n=n, temperature=temperature, max_tokens=1, seed=0))[0].outputs
    assert len(outputs) == n
    probs = torch.softmax(hf_default.logits(prompt_ids)[-1] / temperature, dim=-1)
    counts: dict[int, int] = {}
    for o in outputs:
        counts[o.token_ids[0]] = counts.get(o.token_ids[0], 0) + 1
    for token in probs.topk(3).indices.tolist():
        expected = float(probs[token])
        observed = counts.get(token, 0) / n
        assert abs(observed - expected) < 4 * math.sqrt(expected * (1 - expected) / n) + 0.01, (
            token,
            observed,
            expected,
        )


def test_logprobs_match_transformers(llm, prompt_ids, hf_default):
    out = _run(llm, [prompt_ids], SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=3))[0]
    tokens = out.outputs[0].token_ids
    reference = torch.log_softmax(hf_default.logits(prompt_ids + tokens), dim=-1)
    n_prompt = len(prompt_ids)
    for i, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
        row = reference[n_prompt - 1 + i]
        assert abs(entry[token].logprob - float(row[token])) < 1e-3
        assert entry[token].rank == 1
        top5 = row.topk(5)
        ours_top = sorted(((lp.rank, t) for t, lp in entry.items() if lp.rank <= 5))
        assert [t for _, t in ours_top] == top5.indices.tolist()
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(tokens, out.outputs[0].logprobs, strict=True))
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n_prompt
    for pos in range(1, n_prompt):
        token = prompt_ids[pos]
        assert abs(out.prompt_logprobs[pos][token].logprob - float(reference[pos - 1][token])) < 1e-3


def test_repetition_penalty_matches_transformers(llm, prompt_ids, hf_default):
    import torch as t

    ours = _run(llm, [prompt_ids], SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3))[0]
    ref = hf_default.model.generate(
        t.tensor([prompt_ids]),
        max_new_tokens=16,
        do_sample=False,
        repetition_penalty=1.3,
        attention_mask=t.ones(1, len(prompt_ids), dtype=t.long),
    )[0, len(prompt_ids) :].tolist()
    assert ours.outputs[0].token_ids == ref


def test_presence_and_frequency_penalties(llm, prompt_ids, hf_default):
    """Greedy with OpenAI-style penalties: each token is the argmax of the reference logits minus penalties."""
    params = SamplingParams(temperature=0, max_tokens=12, presence_penalty=1.5, frequency_penalty=0.5)
    tokens = _run(llm, [prompt_ids], params)[0].outputs[0].token_ids
    logits = hf_default.logits(prompt_ids + tokens)
    for i, token in enumerate(tokens):
        row = logits[len(prompt_ids) - 1 + i].clone()
        counts = torch.bincount(torch.tensor(tokens[:i], dtype=torch.long), minlength=row.numel()).float()
        row -= 0.5 * counts + 1.5 * (counts > 0).float()
        top2 = row.topk(2).values
        assert token == int(row.argmax()) or float(top2[0] - top2[1]) < 1e-3


def test_stop_string_spanning_tokens(llm, prompt_ids, default_tokenizer):
    full = _run(llm, [prompt_ids], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [default_tokenizer.decode(full.token_ids[:k]) for k in range(len(full.token_ids) + 1)]
    start = len(pieces[3]) - 1
    stop = full.text[start : len(pieces[5]) + 1]
    assert stop and full.text.find(stop) == start
    out = _run(llm, [prompt_ids], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert out.text == full.text[:start]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = _run(
        llm,
        [prompt_ids],
        SamplingParams(temperature=0, max_tokens=24, stop=stop, include_stop_str_in_output=True),
    )
    assert kept[0].outputs[0].text == full.text[: start + len(stop)]


def test_min_tokens_and_stop_token_ids(llm, default_tokenizer):
    text = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    eos = default_tokenizer.eos_token_id
    plain = _run(llm, [ids], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert plain.token_ids[-1] == eos and len(plain.token_ids) < 12
    longer = _run(llm, [ids], SamplingParams(temperature=0, max_tokens=40, min_tokens=12))[0].outputs[0]
    assert len(longer.token_ids) >= 12 and eos not in longer.token_ids[:12]
    stop_at = plain.token_ids[2]
    stopped = _run(llm, [ids], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_at]))[0].outputs[0]
    assert stopped.token_ids == plain.token_ids[:3] and stopped.stop_reason == stop_at
    ignored = _run(llm, [ids], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(ignored.token_ids) == 20 and ignored.finish_reason == "length"


def test_n_samples_share_the_prompt_blocks(llm, default_tokenizer):
    ids = default_tokenizer.encode(" ".join(["A long shared prompt about the sea and the sky."] * 8))
    before = llm.engine.stats().prefix_hits
    out = _run(llm, [ids], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=24))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    block = llm.engine.config.cache.block_size
    assert llm.engine.stats().prefix_hits - before >= 3 * ((len(ids) - 1) // block * block)
    again = _run(llm, [ids], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=24))[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]

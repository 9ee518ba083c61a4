"""Speculative decoding with a draft model on tiny random models: the served model's greedy tokens and logprobs
(against transformers and against plain decoding of the same engine settings) whatever the draft, with chunked
prefill, prefix caching and preemption; the draft's own cache checked by a draft that is the served checkpoint
itself, whose every draft must be confirmed; sampled requests' tokens (speculative sampling) against the exact
distribution of plain sampling.

Three drafts: the served checkpoint itself (every draft confirmed: its cache on the shared blocks must hold what
the served model's does), its int4 copy (`self-int4`: some confirmed, some not) and an unrelated tiny Llama of
another shape (almost none confirmed: the rejection path)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from heteroserve import LLM, SamplingParams
from tests.model.tiny_models import (
    TinyModel,
    build_hf_model,
    check_output,
    greedy_params,
    prompts,
    run,
    save_tiny,
)

NEW_TOKENS = 24
K = 4
# Prompts over several 16-token blocks, two sharing a 32-token prefix (prefix caching), chunked by the budget.
SETTINGS = {"max_num_batched_tokens": 40, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> TinyModel:
    return save_tiny("qwen2", tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A Llama of another shape (one layer, hidden 32, one KV head) over the same 320-token vocabulary."""
    folder = tmp_path_factory.mktemp("draft") / "other"
    overrides = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
    build_hf_model("llama", overrides, seed=11).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def token_prompts(served) -> list[list[int]]:
    lengths = [5, 70, 17, 33, 9, 48]
    batch = prompts(21, lengths, served.vocab_size)
    batch[3] = batch[1][:32] + batch[3][:1]  # the first two blocks of prompt 1, then its own token
    return batch


@pytest.fixture(scope="module")
def plain(served) -> LLM:
    return served.llm(**SETTINGS)


def _draft(name: str, served: TinyModel, other_draft: str) -> str:
    return {"itself": str(served.folder), "self-int4": "self-int4", "other": other_draft}[name]


@pytest.mark.parametrize("draft", ["itself", "self-int4", "other"])
def test_tokens_and_logprobs_are_the_served_models(draft, served, other_draft, token_prompts, plain, greedy_comparison):
    spec = {"model": _draft(draft, served, other_draft), "num_speculative_tokens": K}
    llm = served.llm(**SETTINGS, speculative_config=spec)
    params = greedy_params(served.vocab_size, prompt_logprobs=False, max_tokens=NEW_TOKENS)
    outputs = run(llm, token_prompts, params)
    expected = run(plain, token_prompts, params)
    for i, (output, prompt) in enumerate(zip(outputs, token_prompts, strict=True)):
        check_output(
            f"draft {draft}[{i}]",
            output,
            prompt,
            served.reference,
            greedy_comparison,
            max_tokens=NEW_TOKENS,
            expect_prompt_logprobs=False,
        )
        assert output.outputs[0].token_ids == expected[i].outputs[0].token_ids, f"{draft}[{i}] differs from plain"
    stats = llm.engine.stats()
    drafted, accepted = stats.spec_draft_tokens, stats.spec_accepted_tokens
    print(f"draft {draft}: {accepted} of {drafted} drafts confirmed ({accepted / drafted:.0%})")
    assert stats.prefix_hits >= 32, "prompt 3 should have read prompt 1's two cached blocks"
    if draft == "itself":
        assert accepted == drafted, "a draft that is the served model must have every draft confirmed"
    elif draft == "self-int4":
        assert 0 < accepted < drafted
    else:
        assert accepted < drafted / 4
    pool = llm.engine.scheduler.kv_cache.managers[0].pool
    assert pool.num_free_blocks == pool.num_blocks


def test_every_confirmed_draft_saves_a_step(served, token_prompts, plain):
    llm = served.llm(**SETTINGS, speculative_config={"model": str(served.folder), "num_speculative_tokens": K})
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = []
    for engine in (plain.engine, llm.engine):
        accepted_before = engine.stats().spec_accepted_tokens
        engine.add_request("one", {"prompt_token_ids": token_prompts[2]}, params)
        steps = 0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps += 1
        runs.append((steps, outputs[0].outputs[0].token_ids, engine.stats().spec_accepted_tokens - accepted_before))
    (plain_steps, plain_tokens, _), (spec_steps, spec_tokens, accepted) = runs
    assert spec_tokens == plain_tokens
    # The prompt's step gives the first token and its drafts; each later step confirms all K and adds one.
    assert accepted == NEW_TOKENS - spec_steps
    assert spec_steps == plain_steps - accepted == -(-(NEW_TOKENS - 1) // (K + 1)) + 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # max_tokens cuts the drafts
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, min_tokens=5),  # per-row penalties
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[7, 19, 101, 250]),  # a stop inside the drafts
    ],
)
def test_outputs_equal_plain_decoding(params, served, token_prompts, plain):
    llm = served.llm(**SETTINGS, speculative_config={"model": "self-int4", "num_speculative_tokens": K})
    for mine, theirs in zip(run(llm, token_prompts, params), run(plain, token_prompts, params), strict=True):
        a, b = mine.outputs[0], theirs.outputs[0]
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason)


# Sampled continuations: 4 tokens from the 3 likeliest at temperature 0.9, so a continuation is one of 81 paths
# whose probabilities transformers' logits give exactly.
SAMPLED_TOKENS, SAMPLED_TOP_K, TEMPERATURE, SAMPLES, SEED_BASE = 4, 3, 0.9, 2400, 5000


def path_probabilities(
    served: TinyModel, prompt: list[int], temperature: float = TEMPERATURE
) -> dict[tuple[int, ...], float]:
    """Every continuation of SAMPLED_TOKENS tokens with its probability under plain sampling: at each position
    softmax over the top SAMPLED_TOP_K of transformers' logits / temperature."""
    paths = {(): 1.0}
    for _ in range(SAMPLED_TOKENS):
        longer = {}
        for path, probability in paths.items():
            with torch.no_grad():
                logits = served.reference.model(torch.tensor([prompt + list(path)])).logits[0, -1].double()
            top = logits.topk(SAMPLED_TOP_K)
            for token, p in zip(top.indices.tolist(), torch.softmax(top.values / temperature, 0).tolist(), strict=True):
                longer[(*path, token)] = probability * p
        paths = longer
    return paths


def chi_square(counts: Counter, exact: dict[tuple[int, ...], float]) -> tuple[float, int]:
    """The chi-square test's p-value of sampled paths' counts against their exact probabilities (paths expected
    fewer than 5 times pooled into one cell), and the number of cells."""
    from scipy.stats import chisquare

    total = sum(counts.values())
    observed, expected, pooled = [], [], [0, 0.0]
    for path, probability in exact.items():
        if probability * total >= 5:
            observed.append(counts[path])
            expected.append(probability * total)
        else:
            pooled[0] += counts[path]
            pooled[1] += probability * total
    observed.append(pooled[0])
    expected.append(pooled[1])
    return chisquare(observed, expected).pvalue, len(observed)


@pytest.mark.parametrize(
    "spec",
    [
        {"model": "other", "num_speculative_tokens": 3},  # most drafts refused: the residual distribution
        {"model": "self-int4", "num_speculative_tokens": 3},  # most kept: the last token after them
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},  # one-hot
        None,  # plain sampling: the test's own calibration
    ],
    ids=["other", "self-int4", "ngram", "plain"],
)
def test_sampled_requests_keep_the_models_distribution(spec, served, other_draft):
    """Speculative sampling: SAMPLES seeded continuations against the exact distribution of plain sampling
    (transformers' logits), by a chi-square test over the 81 paths (cells of expected count under 5 pooled);
    seeded requests make the verdict the same on every run. Dropping the rejection step (every draft kept) fails
    it: the other draft's paths are then the draft's."""
    if spec is not None and spec.get("model") == "other":
        spec = {**spec, "model": other_draft}
    # The prompt repeats its start with likely continuations of it between, so the n-gram proposer finds earlier
    # occurrences to draft from (about one a request; its drafts are then mostly refused: the residual path).
    start = prompts(5, [12], served.vocab_size)[0]
    likely = path_probabilities(served, start)
    prompt = start + [t for path in sorted(likely, key=likely.get)[-6:] for t in path] + start
    exact = path_probabilities(served, prompt)
    llm = served.llm(max_num_seqs=256, num_kv_blocks=512, **({"speculative_config": spec} if spec else {}))
    batch = [
        SamplingParams(
            temperature=TEMPERATURE, top_k=SAMPLED_TOP_K, max_tokens=SAMPLED_TOKENS, ignore_eos=True, seed=seed
        )
        for seed in range(SEED_BASE, SEED_BASE + SAMPLES)
    ]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * SAMPLES, batch, use_tqdm=False)
    counts = Counter(tuple(o.outputs[0].token_ids) for o in outputs)
    assert set(counts) <= set(exact), "a continuation outside the top-k paths"
    p_value, cells = chi_square(counts, exact)
    stats = llm.engine.stats()
    print(
        f"{spec}: chi-square p={p_value:.3f} over {cells} cells; "
        f"{stats.spec_accepted_tokens} of {stats.spec_draft_tokens} drafts kept"
    )
    if spec is not None:  # the n-gram proposer's drafts come where the prompt's tokens follow: about a third
        assert stats.spec_draft_tokens > SAMPLES / 4, "the sampled requests took too few drafts to test anything"
    assert p_value > 1e-3


def test_preempted_requests_keep_their_tokens(served, other_draft, token_prompts, greedy_comparison):
    """14 blocks for six requests that need up to 7 each: preemption by recompute rebuilds both caches."""
    spec = {"model": str(served.folder), "num_speculative_tokens": K}
    llm = served.llm(max_num_batched_tokens=40, num_kv_blocks=14, speculative_config=spec)
    outputs = run(llm, token_prompts, greedy_params(served.vocab_size, prompt_logprobs=False, max_tokens=NEW_TOKENS))
    for i, (output, prompt) in enumerate(zip(outputs, token_prompts, strict=True)):
        check_output(
            f"preempted draft[{i}]",
            output,
            prompt,
            served.reference,
            greedy_comparison,
            max_tokens=NEW_TOKENS,
            expect_prompt_logprobs=False,
        )
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens


def test_drafts_never_pass_max_model_len(served):
    """A request that ends at max_model_len: its lookahead slots stop there and so do its drafts."""
    llm = served.llm(
        max_model_len=40, num_kv_blocks=3, speculative_config={"model": str(served.folder), "num_speculative_tokens": K}
    )
    prompt = prompts(3, [29], served.vocab_size)[0]
    output = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert len(output.token_ids) == 11 and output.finish_reason == "length"


def test_refusals(served, tmp_path):
    wider = tmp_path / "wider"
    build_hf_model("llama", {"vocab_size": 384}, seed=1).save_pretrained(wider)
    with pytest.raises(ValueError, match="has 384 tokens and the served model 320"):
        served.llm(speculative_config={"model": str(wider)})
    windowed = save_tiny("mistral", tmp_path)
    with pytest.raises(ValueError, match="the draft no sliding-window ones"):
        served.llm(speculative_config={"model": str(windowed.folder)})
    with pytest.raises(ValueError, match="already runs quantised \\(int4\\)"):
        served.llm(quantization="int4", speculative_config={"model": "self-int4"})
    with pytest.raises(ValueError, match="prompt_lookup_max / prompt_lookup_min are for method ngram"):
        served.llm(speculative_config={"model": "self-int4", "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="model is for method draft_model"):
        served.llm(speculative_config={"method": "ngram", "model": "self-int4"})
    with pytest.raises(ValueError, match='draft_model needs a "model"'):
        served.llm(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="quantization int8 contradicts it"):
        served.llm(speculative_config={"model": "self-int4", "quantization": "int8"})


def test_self_int4_of_a_gguf_model_served_from_its_blocks_is_refused():
    with pytest.raises(ValueError, match="already runs from its quantised blocks"):
        LLM(max_model_len=256, kv_cache_memory_bytes=64 * 1024**2, speculative_config={"model": "self-int4"})


def test_a_draft_with_fewer_token_rows_takes_the_requests_token_rules(tmp_path, default_tokenizer):
    """The same tokenizer over embeddings of different sizes (checkpoints pad their vocabularies differently): a
    sampled request biased towards an id only the served model has still runs, its drafts (never that id) are
    refused, and every token is the biased one, as without speculation."""
    extra = 64
    vocab = len(default_tokenizer)
    small = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
    served, draft = tmp_path / "served", tmp_path / "draft"
    for folder, overrides, seed in ((served, {"vocab_size": vocab + extra}, 3), (draft, {"vocab_size": vocab}, 4)):
        build_hf_model("llama", {**small, **overrides}, seed=seed).save_pretrained(folder)
        default_tokenizer.save_pretrained(folder)
    biased = vocab + extra // 2
    llm = LLM(
        model=str(served),
        max_model_len=64,
        num_kv_blocks=16,
        dtype="float32",
        speculative_config={"model": str(draft), "num_speculative_tokens": K},
    )
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=9, ignore_eos=True, logit_bias={biased: 100.0})
    output = run(llm, [[1, 2, 3, 4, 5]], params)[0].outputs[0]
    assert output.token_ids == [biased] * 9
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == 0

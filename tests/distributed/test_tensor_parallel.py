"""Tensor and pipeline parallelism on tiny models: worker processes on this machine, checked against
transformers on the same weights (logits and greedy tokens, the near-tie rule of tests/reference.py).

Each engine starts its ranks as processes (~15 s on 2 cores), so each engine is built once per module.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from heteroserve.engine.async_engine import AsyncLLMEngine
from heteroserve.entrypoints.openai.api_server import build_app
from heteroserve.entrypoints.openai.serving import ServerSettings
from tests.model.tiny_models import (
    TinyModel,
    build_hf_model,
    check_output,
    greedy_params,
    load_reference,
    prompts,
    run,
    save_tiny,
)

NEW_TOKENS = 8
LENGTHS = [5, 23, 12]  # one prompt over a 16-token block, so decodes read the paged cache


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> TinyModel:
    return save_tiny("qwen2", tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory) -> TinyModel:
    """Tied embeddings, one KV head (copied to both ranks) and an odd vocabulary (shards of 161 and 160)."""
    overrides = {"tie_word_embeddings": True, "num_key_value_heads": 1, "vocab_size": 321}
    folder = tmp_path_factory.mktemp("tp") / "one_kv_head"
    build_hf_model("llama", overrides, seed=3).save_pretrained(folder)
    return TinyModel("one_kv_head", folder, load_reference(folder))


def _check_against_transformers(tiny: TinyModel, comparison, label: str, **parallel) -> None:
    llm = tiny.llm(**parallel)
    try:
        token_prompts = prompts(7, LENGTHS, tiny.vocab_size)
        outputs = run(llm, token_prompts, greedy_params(tiny.vocab_size, max_tokens=NEW_TOKENS))
        for i, (output, prompt) in enumerate(zip(outputs, token_prompts, strict=True)):
            check_output(f"{label}[{i}]", output, prompt, tiny.reference, comparison, max_tokens=NEW_TOKENS)
    finally:
        llm.shutdown()


def test_tensor_parallel_2_matches_transformers(qwen2, greedy_comparison):
    _check_against_transformers(qwen2, greedy_comparison, "qwen2 tp=2", tensor_parallel_size=2)


def test_tensor_parallel_replicated_kv_head_and_uneven_vocabulary(one_kv_head, greedy_comparison):
    _check_against_transformers(one_kv_head, greedy_comparison, "1-kv-head tp=2", tensor_parallel_size=2)


@pytest.mark.parametrize(
    "family, parallel",
    [
        ("granite", "tensor_parallel_size"),
        ("gemma2", "tensor_parallel_size"),
        ("gemma2", "pipeline_parallel_size"),
        ("qwen2_moe", "tensor_parallel_size"),
        ("gpt_oss", "tensor_parallel_size"),
        ("deepseek_v2", "tensor_parallel_size"),
        ("deepseek_v3", "tensor_parallel_size"),
        ("deepseek_v3", "enable_expert_parallel"),
    ],
)
def test_families_with_biases_soft_capping_and_windows_over_two_ranks(family, parallel, tmp_path, greedy_comparison):
    """Granite: biases on every projection (the row-parallel ones added once, after the all-reduce) and residual
    multipliers; Gemma 2: soft-capped scores and logits, sandwich norms, alternating windows, and over two pipeline
    stages whose layers use different sets of windows (a window layer and a global one, then a window layer): each
    stage keeps every KV group, in the model's order; Qwen2-MoE: each rank a slice of every expert and of the gated
    shared expert, routed on the whole hidden state, the partial sums all-reduced with the dense layer's; gpt-oss:
    each rank its heads' sinks, the experts' output biases added by one rank; DeepSeek-V2 / V3: latent attention
    with each rank's query heads (q_proj, or q_b_proj after the replicated bottleneck), their rows of kv_b_proj
    and columns of o_proj, the latent and its KV cache on both ranks, group-limited routing over sliced experts
    (or, with expert parallelism, over each rank's whole experts)."""
    tiny = save_tiny(family, tmp_path)
    ranks = {"tensor_parallel_size": 2, "enable_expert_parallel": True} if parallel == "enable_expert_parallel" else {}
    _check_against_transformers(tiny, greedy_comparison, f"{family} {parallel}", **(ranks or {parallel: 2}))


def test_expert_parallel_holds_whole_experts_per_rank(tmp_path, greedy_comparison):
    """--enable-expert-parallel: each of 2 ranks holds 4 of Qwen2-MoE's 8 experts whole (and half of the gated
    shared expert and of the attention heads); a dense model refuses the flag."""
    tiny = save_tiny("qwen2_moe", tmp_path)
    _check_against_transformers(
        tiny, greedy_comparison, "qwen2_moe ep=2", tensor_parallel_size=2, enable_expert_parallel=True
    )
    dense = save_tiny("qwen2", tmp_path / "dense")
    for ranks in (2, 1):
        with pytest.raises(ValueError, match="--enable-expert-parallel: qwen2 has no mixture-of-experts layers"):
            dense.llm(tensor_parallel_size=ranks, enable_expert_parallel=True)


def test_norm_over_all_heads_refuses_tensor_parallelism(tmp_path):
    tiny = save_tiny("olmo2", tmp_path)
    with pytest.raises(ValueError, match="normalises q and k over all heads"):
        tiny.llm(tensor_parallel_size=2)


def test_pipeline_parallel_2_matches_transformers(qwen2, greedy_comparison):
    _check_against_transformers(qwen2, greedy_comparison, "qwen2 pp=2", pipeline_parallel_size=2)


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_draft_model_speculation_over_two_ranks(parallel, qwen2, greedy_comparison):
    """The draft model (here the checkpoint itself, so every draft must be confirmed) runs on the sampling rank
    only; its drafts reach the other rank with the next step."""
    llm = qwen2.llm(**{parallel: 2}, speculative_config={"model": str(qwen2.folder), "num_speculative_tokens": 3})
    try:
        token_prompts = prompts(7, LENGTHS, qwen2.vocab_size)
        outputs = run(llm, token_prompts, greedy_params(qwen2.vocab_size, max_tokens=NEW_TOKENS))
        for i, (output, prompt) in enumerate(zip(outputs, token_prompts, strict=True)):
            label = f"qwen2 {parallel}=2 draft[{i}]"
            check_output(label, output, prompt, qwen2.reference, greedy_comparison, max_tokens=NEW_TOKENS)
        stats = llm.engine.stats()
        assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    finally:
        llm.shutdown()


def test_heads_not_divisible_is_a_clear_error(qwen2):
    expected = (
        r"num_attention_heads=4 is not divisible by tensor_parallel_size=3.*sizes that work for this model: \[1, 2, 4\]"
    )
    with pytest.raises(ValueError, match=expected):
        qwen2.llm(tensor_parallel_size=3)


def test_int4_split_inside_a_group_is_reported_by_the_workers(tmp_path):
    """o_proj has 32 input columns (2 heads x 16), one 4-bit group: 2 ranks would cut it in half. Only the
    loader sees that, inside the workers; the engine must raise their ValueError, not a generic failure."""
    overrides = {"num_attention_heads": 2, "num_key_value_heads": 2, "tie_word_embeddings": False}
    build_hf_model("qwen2", {**overrides, "use_sliding_window": False}, seed=5).save_pretrained(tmp_path)
    model = TinyModel("int4", tmp_path, None)
    with pytest.raises(ValueError, match=r"o_proj.*groups of 32 columns cannot be split at column 16"):
        model.llm(tensor_parallel_size=2, quantization="int4")


def test_worker_killed_mid_run_fails_the_engine_not_hangs(qwen2):
    """A rank killed between steps: the next step raises, clients get a 500 and /health turns 503."""
    engine = AsyncLLMEngine(qwen2.llm(tensor_parallel_size=2).engine)
    app = build_app(engine, ServerSettings(["tiny"]))

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            ok = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            long = asyncio.create_task(
                client.post("/v1/completions", json={"prompt": [4, 5, 6], "max_tokens": 100, "ignore_eos": True})
            )
            while engine.num_steps < 5:  # the long request is being generated
                await asyncio.sleep(0.01)
            engine.engine.executor.processes[1].kill()
            response = await long
            assert response.status_code == 500
            assert "died" in response.json()["error"]["message"] or "failed" in response.json()["error"]["message"]
            assert (await client.get("/health")).status_code == 503

    finished = threading.Event()

    def target():
        asyncio.run(scenario())
        finished.set()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=120)
    engine.shutdown()
    assert finished.is_set(), "the engine hung after a worker died"
    assert all(not p.is_alive() for p in engine.engine.executor.processes)


def test_vision_language_model_over_ranks_is_a_clear_error(tmp_path):
    """The vision tower and image inputs are not split or sent to workers: refused before any worker starts."""
    from tests.model.tiny_vl import save_tiny_vl

    tiny = save_tiny_vl("qwen2_vl", tmp_path)
    with pytest.raises(ValueError, match="qwen2_vl runs on one rank"):
        tiny.llm(tensor_parallel_size=2)

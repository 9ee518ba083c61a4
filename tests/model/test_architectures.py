"""Our decoder against transformers on tiny random checkpoints of every supported architecture.

Every scenario goes through the public `LLM` API and checks each request with `check_output`: prompt
and per-step logprobs (full vocabulary) against transformers' log-softmaxed logits, within 1e-4 of the
logit scale, and greedy tokens against `generate(do_sample=False)` up to a near-tie divergence.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from heteroserve import LLM, SamplingParams
from tests.model.remote_code_checkpoints import write_baichuan, write_chatglm, write_internlm2, write_original_qwen
from tests.model.tiny_models import (
    LOGIT_RTOL,
    NEW_TOKENS,
    SPECS,
    TinyModel,
    as_reference,
    build_hf_model,
    check_output,
    greedy_params,
    prompts,
    run,
    save_tiny,
)


@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory) -> TinyModel:
    return save_tiny(request.param, tmp_path_factory.mktemp("tiny"), seed=list(SPECS).index(request.param))


def _check_all(tiny, label, outputs, token_prompts, comparison, **kwargs) -> None:
    assert len(outputs) == len(token_prompts)
    for i, (output, prompt) in enumerate(zip(outputs, token_prompts, strict=True)):
        check_output(f"{tiny.name}/{label}[{i}]", output, prompt, tiny.reference, comparison, **kwargs)


def test_checkpoint_exercises_its_architecture(tiny):
    """The tiny checkpoints really have what the comparisons are meant to cover."""
    with safe_open(str(tiny.folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
    config = tiny.reference.model.config
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)
    assert any("norm" in n and (t - 1).abs().max() > 0.1 for n, t in tensors.items())
    if tiny.name == "qwen2":
        biases = [t for n, t in tensors.items() if n.endswith("_proj.bias")]
        assert len(biases) == 3 * config.num_hidden_layers and all(b.abs().max() > 0.1 for b in biases)
    if tiny.name == "qwen3":
        assert any(n.endswith("q_norm.weight") and (t - 1).abs().max() > 0.1 for n, t in tensors.items())
        assert config.head_dim * config.num_attention_heads != config.hidden_size

    # Where a config feature is the point (windows, rope variants, caps, multipliers), it changes transformers'
    # logits: each change below, alone, moves them.
    full = ["full_attention"] * 3
    changes = {
        "mistral": [{"sliding_window": None}],
        "llama3": [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}],
        "gemma2": [{"attn_logit_softcapping": None}, {"final_logit_softcapping": None}, {"layer_types": full}],
        "gemma3": [
            {"layer_types": full},
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
        ],
        "phi3": [
            {"sliding_window": None},
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}},
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
        ],
        "glm": [{"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}],
        "smollm3": [{"no_rope_layers": [1, 1, 1]}],
        "granite": [
            {"embedding_multiplier": 1.0},
            {"residual_multiplier": 1.0},
            {"attention_multiplier": 0.25},
            {"logits_scaling": 1.0},
        ],
        "mixtral": [{"num_experts_per_tok": 1}],
        "qwen2_moe": [{"norm_topk_prob": True}],
        "glm4_moe": [{"routed_scaling_factor": 1.0}, {"n_group": 1, "topk_group": 1}],
        "gpt_oss": [{"swiglu_limit": 7.0}],
        "deepseek_v2": [{"topk_method": "greedy"}],
        "deepseek_v3": [{"rope_interleave": False}, {"n_group": 1, "topk_group": 1}],
    }.get(tiny.name, [])
    ids = prompts(99, [40], config.vocab_size)[0]
    base = tiny.reference.logits(ids)
    for change in changes:
        variant = AutoModelForCausalLM.from_pretrained(
            tiny.folder, dtype=torch.float32, attn_implementation="eager", **change
        ).eval()
        with torch.inference_mode():
            other = variant(torch.tensor([ids])).logits[0]
        assert (other - base).abs().max() > 0.1 * base.abs().max(), f"{tiny.name}: {change} changes nothing"
    if tiny.name == "gpt_oss":  # without its sinks, every layer's attention moves the logits
        sinkless = AutoModelForCausalLM.from_pretrained(tiny.folder, dtype=torch.float32, attn_implementation="eager")
        with torch.inference_mode():
            for layer in sinkless.model.layers:
                layer.self_attn.sinks.fill_(float("-inf"))
            other = sinkless(torch.tensor([ids])).logits[0]
        assert (other - base).abs().max() > 0.1 * base.abs().max(), "gpt_oss: the sinks change nothing"


def test_single_prompt(tiny, greedy_comparison):
    token_prompts = prompts(1, [40], tiny.vocab_size)
    outputs = run(tiny.llm(), token_prompts, greedy_params(tiny.vocab_size))
    _check_all(tiny, "single", outputs, token_prompts, greedy_comparison)


def test_batched_prompts_of_different_lengths(tiny, greedy_comparison):
    token_prompts = prompts(2, [3, 17, 9, 41, 1], tiny.vocab_size)
    outputs = run(tiny.llm(block_size=8), token_prompts, greedy_params(tiny.vocab_size))
    _check_all(tiny, "batched", outputs, token_prompts, greedy_comparison)


def test_chunked_prefill(tiny, greedy_comparison):
    """An 8-token budget splits every prompt into chunks that attend to their cached prefix."""
    token_prompts = prompts(3, [27, 12, 19], tiny.vocab_size)
    llm = tiny.llm(block_size=4, max_num_batched_tokens=8)
    outputs = run(llm, token_prompts, greedy_params(tiny.vocab_size))
    _check_all(tiny, "chunked", outputs, token_prompts, greedy_comparison)


def test_prefix_caching(tiny, greedy_comparison):
    """Later requests sharing a 26-token prefix read its KV from the cache and still match."""
    shared, tail_a, tail_b = prompts(4, [26, 5, 7], tiny.vocab_size)
    first, second, again = shared + tail_a, shared + tail_b, shared + tail_a
    llm = tiny.llm(block_size=4)
    outputs = run(llm, [first], greedy_params(tiny.vocab_size))
    assert outputs[0].num_cached_tokens == 0
    _check_all(tiny, "prefix-first", outputs, [first], greedy_comparison)

    # Prompt logprobs would bypass the prefix cache, so these requests ask for sample logprobs only.
    later = run(llm, [second, again], greedy_params(tiny.vocab_size, prompt_logprobs=False))
    assert later[0].num_cached_tokens == 24  # the 6 full 4-token blocks of the shared prefix
    assert later[1].num_cached_tokens == 28  # all full blocks but the one holding the last prompt token
    assert later[0].metrics.num_cached_tokens == 24
    _check_all(tiny, "prefix-cached", later, [second, again], greedy_comparison, expect_prompt_logprobs=False)


def test_preemption(tiny, greedy_comparison):
    """Eight 8-token blocks cannot hold four ~40-token requests: some are preempted and recomputed."""
    token_prompts = prompts(5, [20, 23, 26, 18], tiny.vocab_size)
    llm = tiny.llm(block_size=8, num_kv_blocks=8, max_model_len=64)
    outputs = run(llm, token_prompts, greedy_params(tiny.vocab_size))
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert llm.engine.stats().num_preemptions > 0
    _check_all(tiny, "preempted", outputs, token_prompts, greedy_comparison)


def test_reference_kernels(tiny, greedy_comparison):
    """The plain-torch operators (what faster platform kernels are checked against) match too."""
    token_prompts = prompts(5, [12, 30], tiny.vocab_size)
    llm = tiny.llm(kernels="reference")
    assert llm.engine.runner.model.linear.name == "torch.linear"
    outputs = run(llm, token_prompts, greedy_params(tiny.vocab_size))
    _check_all(tiny, "reference-kernels", outputs, token_prompts, greedy_comparison)


# Layouts whose code is in the model repositories, against the transformers class of their architecture on the
# same weights (tests/model/remote_code_checkpoints.py writes them): the original Qwen is Qwen2 with as many KV
# heads as query heads, ChatGLM2/3 is GLM.
REMOTE_CODE = {
    "qwen": ("qwen2", {"num_key_value_heads": 4, "tie_word_embeddings": False}, write_original_qwen),
    "internlm2": ("llama", {"tie_word_embeddings": False}, write_internlm2),
    "baichuan": (
        "llama",
        {"num_key_value_heads": 4, "tie_word_embeddings": False},
        lambda model, folder: write_baichuan(model, folder, "BaiChuanForCausalLM"),
    ),
    "chatglm": (
        "glm",
        {
            "attention_bias": True,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 2e4, "partial_rotary_factor": 0.5},
        },
        write_chatglm,
    ),
}


@pytest.mark.parametrize("layout", list(REMOTE_CODE))
def test_remote_code_layout_matches_its_architecture(layout, tmp_path, greedy_comparison):
    model_type, overrides, write = REMOTE_CODE[layout]
    model = build_hf_model(model_type, overrides, seed=40)
    write(model, tmp_path / layout)
    assert json.loads((tmp_path / layout / "config.json").read_text())["model_type"] == layout
    tiny = TinyModel(layout, tmp_path / layout, as_reference(model))
    token_prompts = prompts(9, [40, 13], tiny.vocab_size)
    for kernels in ("auto", "reference"):  # the fused decode layer where the platform has one, then without
        outputs = run(tiny.llm(kernels=kernels, block_size=8), token_prompts, greedy_params(tiny.vocab_size))
        _check_all(tiny, f"{layout} ({kernels})", outputs, token_prompts, greedy_comparison)


def test_original_qwen_context_past_seq_length_is_refused(tmp_path):
    """Dynamic NTK and log-n attention scaling act past seq_length; the context is held to it."""
    model = build_hf_model("qwen2", REMOTE_CODE["qwen"][1], seed=41)
    write_original_qwen(model, tmp_path / "qwen")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=str(tmp_path / "qwen"), max_model_len=512, num_kv_blocks=64)


def test_window_layers_keep_only_their_window(tmp_path, greedy_comparison):
    """Gemma 3's layers (here: window 8, global, window 8) in two KV groups. The budget is shared so both groups
    hold as many max_model_len requests, the window's group counting only a window and a step's tokens: the
    global layers get more context than one pool for all three layers would give. While a long request
    decodes, the window's layers hold only the blocks the window sees, and the tokens still match transformers."""
    tiny = save_tiny("gemma3", tmp_path)
    budget, block = 2**20, 4
    llm = tiny.llm(num_kv_blocks=None, kv_cache_memory_bytes=budget, block_size=block, max_num_batched_tokens=16)
    runner = llm.engine.executor.worker.runner
    assert runner.windows == [None, 8]  # full attention first, then the windows
    one_layer_block = 2 * block * 2 * 16 * 4  # k and v, 2 KV heads of 16 float32 values
    groups = {g.sliding_window: g.num_blocks for g in runner.kv_groups}
    assert groups[8] * 2 * one_layer_block + groups[None] * one_layer_block <= budget
    one_pool = budget // (3 * one_layer_block)
    assert groups[None] > 2 * one_pool, (groups, one_pool)
    print(f"KV groups {groups} against one pool of {one_pool} blocks for all layers")

    prompt = prompts(12, [41], tiny.vocab_size)[0]
    engine = llm.engine
    engine.add_request("long", {"prompt_token_ids": prompt}, greedy_params(tiny.vocab_size))
    kv = engine.scheduler.kv_cache
    window_group, full_group = kv.managers[kv.windows.index(8)], kv.managers[kv.windows.index(None)]
    finished, held = [], []
    while not finished:
        finished = [o for o in engine.step() if o.finished]
        tokens = engine.scheduler.running[0].num_computed_tokens if engine.scheduler.running else None
        if tokens:
            held.append((full_group.num_live_blocks("long"), window_group.num_live_blocks("long")))
            assert held[-1][0] == -(-tokens // block)
            assert held[-1][1] <= -(-(8 - 1 + 16) // block) + 1  # a window and a 16-token step
    assert held[-1] == (-(-(41 + NEW_TOKENS - 1) // block), 3)  # decoding: 8 keys span at most 3 blocks of 4
    _check_all(tiny, "gemma3 kv groups", finished, [prompt], greedy_comparison)
    assert kv.usage == 0.0


def test_baichuan2_normalises_its_output_layer_and_refuses_alibi(tmp_path, greedy_comparison):
    """Baichuan2's vocabulary marks its NormHead: the output layer's rows are normalised at load (the checkpoint
    stores them scaled, the reference holds them normalised). A 13B-style BaichuanForCausalLM (ALiBi) is refused."""
    from heteroserve.model.loader.remote_code_layouts import BAICHUAN2_VOCAB

    overrides = {"num_key_value_heads": 4, "tie_word_embeddings": False, "vocab_size": BAICHUAN2_VOCAB}
    model = build_hf_model("llama", overrides, seed=42)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.nn.functional.normalize(model.lm_head.weight, dim=-1) * 4)
        scales = torch.rand(BAICHUAN2_VOCAB, generator=torch.Generator().manual_seed(0)) + 0.5
        write_baichuan(model, tmp_path / "b2", "BaichuanForCausalLM", row_scales=scales)
        model.lm_head.weight.copy_(torch.nn.functional.normalize(model.lm_head.weight, dim=-1))
    raw = json.loads((tmp_path / "b2" / "config.json").read_text())
    with pytest.raises(ValueError, match="ALiBi"):
        LLM(model=str(tmp_path / "b2"), max_model_len=64, num_kv_blocks=16)
    (tmp_path / "b2" / "config.json").write_text(json.dumps({**raw, "architectures": ["BaiChuanForCausalLM"]}))
    reference = as_reference(model)
    prompt = prompts(13, [20], 320)[0]
    llm = LLM(model=str(tmp_path / "b2"), max_model_len=64, num_kv_blocks=16, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    greedy_comparison.check("baichuan2 NormHead", tokens, reference.greedy(prompt, 6))
    logits = reference.logits(prompt + tokens[:-1])[len(prompt) - 1 :]
    expected = torch.log_softmax(logits, -1)[torch.arange(6), torch.tensor(tokens)]
    ours = torch.tensor([entry[t].logprob for entry, t in zip(out.logprobs, tokens, strict=True)])
    assert (ours - expected).abs().max() <= LOGIT_RTOL * logits.abs().max()


def test_longrope_context_is_its_original_one(tmp_path):
    """LongRoPE's short factors hold within the original context (where the sequences above match transformers);
    the context defaults to it and a longer one is refused, naming why."""
    tiny = save_tiny("phi3", tmp_path)
    assert tiny.reference.model.config.max_position_embeddings == 256
    assert LLM(model=str(tiny.folder), num_kv_blocks=32).engine.model.max_model_len == 128
    with pytest.raises(ValueError, match="LongRoPE's long factors"):
        LLM(model=str(tiny.folder), max_model_len=200, num_kv_blocks=32)


def test_latent_attention_caches_one_latent_a_token(tmp_path, greedy_comparison):
    """DeepSeek's KV cache holds the latent and the rotary key once a token (32 + 8 values a layer here, one tensor
    read as both keys and values), where the attention it computes has 4 heads of 24-wide keys and 16-wide values
    (160 values a token and layer in a multi-head cache). Over two pipeline stages too (two tensor-parallel ranks:
    tests/distributed/test_tensor_parallel.py)."""
    tiny = save_tiny("deepseek_v3", tmp_path)
    llm = tiny.llm(block_size=4)
    runner = llm.engine.runner
    layers = tiny.reference.model.config.num_hidden_layers
    assert runner.bytes_per_block() == layers * 4 * (32 + 8) * 4
    assert all(k.data_ptr() == v.data_ptr() for k, v in runner.layer_caches)
    token_prompts = prompts(8, [50, 9], tiny.vocab_size)
    _check_all(
        tiny, "latent", run(llm, token_prompts, greedy_params(tiny.vocab_size)), token_prompts, greedy_comparison
    )
    staged = tiny.llm(pipeline_parallel_size=2)
    try:
        outputs = run(staged, token_prompts, greedy_params(tiny.vocab_size, prompt_logprobs=False))
        _check_all(tiny, "latent-pp2", outputs, token_prompts, greedy_comparison, expect_prompt_logprobs=False)
    finally:
        staged.shutdown()


def test_dynamic_ntk_runs_within_its_original_context(tmp_path, greedy_comparison):
    """Dynamic NTK scaling (InternLM2, Llama fine-tunes) leaves the default frequencies up to the original context,
    where transformers' outputs are matched; a longer context is refused, naming why."""
    rope = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    model = build_hf_model("llama", {"tie_word_embeddings": False, "rope_parameters": rope}, seed=9)
    model.save_pretrained(tmp_path / "dynamic")
    tiny = TinyModel("llama-dynamic", tmp_path / "dynamic", as_reference(model))
    token_prompts = prompts(9, [40, 11], tiny.vocab_size)
    _check_all(
        tiny,
        "dynamic",
        run(tiny.llm(), token_prompts, greedy_params(tiny.vocab_size)),
        token_prompts,
        greedy_comparison,
    )
    with pytest.raises(ValueError, match="exceeds the model's 256 positions: dynamic NTK rope scaling"):
        tiny.llm(max_model_len=512)

"""The CPU platform's one-call decode layer (csrc/decode_layer.cpp) against the same model run operator by
operator, through the engine: same greedy tokens, same full-vocabulary logprobs at every step. (Both against
transformers: tests/model/test_architectures.py, which runs with the fused layer on.)"""

from __future__ import annotations

import pytest
import torch

from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.int4 import CpuInt4Weight
from heteroserve.platforms.cpu.packed import bfloat16_gemm_available
from tests.model.tiny_models import greedy_params, prompts, run, save_tiny


@pytest.fixture(scope="module", autouse=True)
def library() -> None:
    if not cpu_kernels.load_library():
        pytest.skip("the C++ kernels cannot be built here (see the warning logged by cpu_kernels)")


def _model(llm):
    return llm.engine.executor.worker.runner.model


def _logprob_rows(output) -> torch.Tensor:
    steps = output.outputs[0].logprobs
    return torch.tensor([[step[t].logprob for t in sorted(step)] for step in steps])


# qwen2: q/k/v biases; mistral: a sliding window shorter than the prompts; llama3: scaled rotary tables;
# int4: 4-bit projections (our C++ kernel, at every row count); int8: 8-bit ones (one group a row).
# qwen3: per-head q/k norms, head_dim 32 != hidden / heads. float16 / bfloat16: a 16-bit KV cache the fused layer
# writes and reads as the operators do. dtype bfloat16: bfloat16 activations and panels (AVX512-BF16 builds).
# Mixtures of experts (the routing and experts in the same call): qwen3_moe (a dense first layer, top-2
# renormalised; 4-bit experts), mixtral (every layer), ernie4_5_moe (a correction bias on the choice, an ungated
# shared expert), qwen2_moe (a sigmoid-gated shared expert, top-3 not renormalised), glm4_moe (sigmoid scores,
# experts chosen within the best of two groups, a routed scale).
CASES = [
    ("qwen2", None, "auto", "float32"),
    ("mistral", None, "auto", "float32"),
    ("llama3", None, "auto", "float32"),
    ("qwen3", None, "auto", "float32"),
    ("qwen2", "int4", "auto", "float32"),
    ("llama3", "int8", "auto", "float32"),
    ("llama3", None, "float16", "float32"),
    ("qwen3", None, "bfloat16", "float32"),
    ("qwen2", None, "auto", "bfloat16"),
    ("qwen3", None, "auto", "bfloat16"),
    ("mistral", None, "auto", "bfloat16"),
    ("qwen3_moe", None, "auto", "float32"),
    ("mixtral", None, "auto", "float32"),
    ("qwen3_moe", "int4", "auto", "float32"),
    ("ernie4_5_moe", None, "auto", "float32"),
    ("qwen3_moe", None, "auto", "bfloat16"),
    ("qwen2_moe", None, "auto", "float32"),
    ("qwen2_moe", None, "auto", "bfloat16"),
    ("glm4_moe", None, "auto", "float32"),
]


@pytest.mark.parametrize("name,quantization,kv_cache_dtype,dtype", CASES)
def test_fused_layer_matches_operator_by_operator(name, quantization, kv_cache_dtype, dtype, tmp_path):
    if dtype == "bfloat16" and not bfloat16_gemm_available():
        pytest.skip("this build has no bfloat16 GEMM (AVX512-BF16): bfloat16 layers are not fused")
    tiny = save_tiny(name, tmp_path)
    # Without prefix caching the second run's prefills are computed as the first run's were, not from cached blocks.
    llm = tiny.llm(
        block_size=8,
        quantization=quantization,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
        dtype=dtype,
    )
    cache_dtype = getattr(torch, dtype if kv_cache_dtype == "auto" else kv_cache_dtype)
    assert llm.engine.executor.worker.runner.kv_cache.dtype == cache_dtype
    layers = _model(llm).layers
    if quantization == "int4" and not isinstance(layers[0].self_attn.qkv_proj, CpuInt4Weight):
        pytest.skip("the C++ kernels cannot be built here")
    fused = [layer.fused_decode for layer in layers]
    assert all(f is not None for f in fused), "every layer takes the fused decode path"
    # 9 decode rows, then 3
    batches = [prompts(5, [3, 17, 9, 30, 5, 11, 8, 21, 2], tiny.vocab_size), prompts(6, [4, 19, 7], tiny.vocab_size)]
    params = greedy_params(tiny.vocab_size, prompt_logprobs=False)

    rows_seen = set()

    def recording(fused_layer):
        def call(x, *args):
            rows_seen.add(x.shape[0])
            return fused_layer(x, *args)

        return call

    for layer, fused_layer in zip(layers, fused, strict=True):
        layer.fused_decode = recording(fused_layer)
    with_fused = [run(llm, batch, params) for batch in batches]
    assert {9, 3} <= rows_seen, "the decode steps of both batches went through the fused layers"
    for layer in layers:
        layer.fused_decode = None
    without = [run(llm, batch, params) for batch in batches]

    for a, b in zip(sum(with_fused, []), sum(without, []), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(_logprob_rows(a), _logprob_rows(b), atol=1e-5, rtol=0)


def test_4bit_decode_rows_are_alike_alone_and_in_a_batch(tmp_path):
    """4-bit rows give the same bits at every row count (csrc/int4_panel_linear.cpp): a request decoded in a batch
    of 9 gets exactly the tokens and logprobs it gets alone."""
    tiny = save_tiny("qwen2", tmp_path)
    llm = tiny.llm(block_size=8, quantization="int4", enable_prefix_caching=False)
    if not isinstance(_model(llm).layers[0].gate_up_proj, CpuInt4Weight):
        pytest.skip("the C++ kernels cannot be built here")
    batch = prompts(7, [8, 17, 9, 30, 12, 11, 8, 21, 10], tiny.vocab_size)
    params = greedy_params(tiny.vocab_size, prompt_logprobs=False)
    together = run(llm, batch, params)
    for prompt, output in zip(batch, together, strict=True):
        alone = run(llm, [prompt], params)[0]
        assert output.outputs[0].token_ids == alone.outputs[0].token_ids
        torch.testing.assert_close(_logprob_rows(output), _logprob_rows(alone), atol=0, rtol=0)


def test_not_fused_where_the_kernel_lacks_the_weight_format(tmp_path):
    """4-bit projections with bfloat16 activations are not in the fused kernel: such layers stay operator by
    operator."""
    tiny = save_tiny("llama_tied", tmp_path)
    llm = tiny.llm(quantization="int4", dtype="bfloat16")
    assert all(layer.fused_decode is None for layer in _model(llm).layers)


def test_reference_kernels_are_never_fused(tmp_path):
    tiny = save_tiny("llama_tied", tmp_path)
    llm = tiny.llm(kernels="reference")
    model = _model(llm)
    assert all(layer.fused_decode is None for layer in model.layers)
    assert model.ops.describe()["decode_layer"] == "operator by operator"
    assert _model(tiny.llm()).ops.describe()["decode_layer"] == "cpp fused decode layer"


def test_a_slot_outside_the_cache_is_an_error(tmp_path):
    tiny = save_tiny("llama_tied", tmp_path)
    llm = tiny.llm(block_size=8)
    model = _model(llm)
    layer = model.layers[0]
    hidden = model.arch.hidden_size
    k_cache = torch.zeros(4, 8, model.arch.num_kv_heads, model.arch.head_dim)
    v_cache = torch.zeros_like(k_cache)
    meta = type("Meta", (), {})()
    meta.slot_mapping = torch.tensor([32])  # 4 blocks of 8 slots: 0..31
    meta.decode_block_tables = torch.tensor([[3]])
    meta.decode_mask = torch.ones(1, 1, 1, 8, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="slot 32 outside the cache"):
        layer.fused_decode(torch.randn(1, hidden), torch.tensor([0]), k_cache, v_cache, meta)
    assert not k_cache.any() and not v_cache.any()


def test_8bit_layers_are_fused_with_the_operator_by_operator_tokens(tmp_path):
    """A Q8_0 GGUF mixture of experts (ERNIE 4.5: grouped 8-bit attention, experts and ungated shared expert, a
    correction bias) runs every layer fused, with the tokens and logprobs of the same layers operator by operator."""
    from heteroserve.entrypoints.llm import LLM
    from heteroserve.platforms.cpu.int8 import CpuGroupedInt8Weight
    from tests.model.test_gguf_moe import ARCHITECTURES, _build, write_moe_gguf

    model, qtype = _build("ernie4_5_moe", quantized=True)
    path = write_moe_gguf(model, ARCHITECTURES["ernie4_5_moe"], tmp_path / "ernie.gguf", qtype)
    # Without prefix caching the second run's prefills are computed as the first run's were, not from cached blocks.
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=8, enable_prefix_caching=False)
    layers = _model(llm).layers
    assert all(isinstance(layer.self_attn.qkv_proj, CpuGroupedInt8Weight) for layer in layers)
    fused = [layer.fused_decode for layer in layers]
    assert all(f is not None for f in fused), "every layer takes the fused decode path"
    vocab = model.config.vocab_size
    batch = prompts(9, [5, 13, 8], vocab)
    params = greedy_params(vocab, prompt_logprobs=False)
    with_fused = run(llm, batch, params)
    for layer in layers:
        layer.fused_decode = None
    without = run(llm, batch, params)
    for a, b in zip(with_fused, without, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(_logprob_rows(a), _logprob_rows(b), atol=1e-5, rtol=0)

"""Tiny randomly initialised checkpoints of every supported architecture, and the checks run on them.

Each model is built from a transformers config with a fixed seed, its weights re-drawn large enough that
logits spread over several units (default init gives near-uniform logits, where any two engines agree),
and saved as a float32 safetensors checkpoint without tokenizer (the engine then takes token ids only).
The transformers model saved there is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from heteroserve.entrypoints.llm import LLM
from heteroserve.outputs import RequestOutput
from heteroserve.sampling_params import SamplingParams
from tests.reference import GreedyComparison, HFReference

VOCAB = 320
MAX_MODEL_LEN = 128
NEW_TOKENS = 16
LOGIT_RTOL = 1e-4  # max abs difference allowed, relative to the largest |logit| of the reference

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "dtype": "float32",
}

# name -> (model_type, config overrides). Each exercises what sets its architecture apart.
SPECS: dict[str, tuple[str, dict]] = {
    # Llama 3.1 rope scaling: with head_dim 16, theta 1e4 and original context 64, the rotary
    # wavelengths fall in all three llama3 regimes (kept, interpolated, divided by the factor).
    "llama3": (
        "llama",
        {
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama_tied": (
        "llama",
        {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
    ),
    # Prompts in the tests are longer than the 8-token window, so the window changes the logits.
    "mistral": ("mistral", {"sliding_window": 8, "tie_word_embeddings": False}),
    "qwen2": ("qwen2", {"tie_word_embeddings": False, "use_sliding_window": False}),
    # head_dim 32 != hidden / heads, as in real Qwen3 checkpoints.
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True, "use_sliding_window": False}),
    # Gemma: GeGLU, 1 + w norms, embeddings scaled by sqrt(hidden).
    "gemma": ("gemma", {"tie_word_embeddings": True}),
    # Gemma 2: sandwich norms, alternating 8-token windows, caps low enough to bite on these logits, a query
    # scale other than head_dim's.
    "gemma2": (
        "gemma2",
        {
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 24,
        },
    ),
    # Gemma 3: per-head q/k norms, local layers on their own rotary base, linear scaling on the global ones.
    "gemma3": (
        "gemma3_text",
        {
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
    # Phi-3: fused qkv and gate_up checkpoints, partial rotary and LongRoPE (Phi-4-mini's), a window on every
    # layer. The tests' sequences stay within the original context, where transformers uses the short factors.
    "phi3": (
        "phi3",
        {
            "tie_word_embeddings": False,
            "sliding_window": 8,
            "original_max_position_embeddings": 128,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.3, 1.9, 2.6, 3.4, 5.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                "original_max_position_embeddings": 128,
            },
        },
    ),
    # GLM: half of each head rotated, in adjacent pairs; q/k/v biases; fused gate_up.
    "glm": ("glm", {"tie_word_embeddings": False, "attention_bias": True}),
    # GLM-4: the same with post-norms on the attention and MLP outputs.
    "glm4": ("glm4", {"tie_word_embeddings": False, "attention_bias": True}),
    # ERNIE 4.5: adjacent-pair rotary over the whole head, biases on every projection.
    "ernie4_5": ("ernie4_5", {"tie_word_embeddings": True, "use_bias": True}),
    # SmolLM3: the middle layer has no position encoding.
    "smollm3": ("smollm3", {"tie_word_embeddings": True, "no_rope_layers": [1, 0, 1], "use_sliding_window": False}),
    # Granite: embedding, residual, attention and logit multipliers; biases everywhere.
    "granite": (
        "granite",
        {
            "tie_word_embeddings": False,
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.1,
            "logits_scaling": 0.5,
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    # OLMo 2: no pre-norms, norms on the sublayer outputs, q/k normalised over all heads.
    "olmo2": ("olmo2", {"tie_word_embeddings": False}),
    # Mixtral: 8 experts, top-2 renormalised, every layer (its checkpoint names experts' projections w1/w3/w2).
    "mixtral": ("mixtral", {"tie_word_embeddings": False, "num_local_experts": 8, "intermediate_size": 48}),
    # Qwen2-MoE: top-3 without renormalisation, a gated shared expert, a dense middle layer.
    "qwen2_moe": (
        "qwen2_moe",
        {
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
        },
    ),
    # Qwen3-MoE: q/k norms, top-2 renormalised, a dense first layer.
    "qwen3_moe": (
        "qwen3_moe",
        {
            "head_dim": 32,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    # ERNIE 4.5 MoE: a correction bias on the choice, a shared expert, experts from the second layer on.
    "ernie4_5_moe": (
        "ernie4_5_moe",
        {
            "tie_word_embeddings": False,
            "moe_num_experts": 8,
            "moe_k": 2,
            "moe_intermediate_size": 32,
            "moe_num_shared_experts": 1,
            "moe_layer_start_index": 1,
            "moe_layer_end_index": 2,
        },
    ),
    # GLM-4.5: sigmoid scores with a correction bias, group-limited choice (1 of 2 groups), routed scaling,
    # a shared expert, a dense first layer, q/k norms, half the head rotated, q/k/v biases.
    "glm4_moe": (
        "glm4_moe",
        {
            "tie_word_embeddings": False,
            "attention_bias": True,
            "use_qk_norm": True,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        },
    ),
    # gpt-oss: attention sinks, alternating 8-token windows, YaRN, biases everywhere, 8 experts with biases chosen
    # by their top-2 logits, a SwiGLU clamped at 2 (low enough to bite on these activations).
    "gpt_oss": (
        "gpt_oss",
        {
            "tie_word_embeddings": False,
            "attention_bias": True,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "swiglu_limit": 2.0,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1.5e5,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
    ),
    # DeepSeek-V2-Lite's shape: latent attention without a query bottleneck (a 32-wide latent for 4 heads of
    # 16 + 8 rotary), YaRN with its mscale, top-3 of softmax scores within the best 2 of 4 groups by each group's
    # best expert, two shared experts, a dense first layer.
    "deepseek_v2": (
        "deepseek_v2",
        {
            "tie_word_embeddings": False,
            "head_dim": 8,
            "num_key_value_heads": 4,  # transformers expands the latent to every head
            "q_lora_rank": None,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "n_shared_experts": 2,
            "first_k_dense_replace": 1,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        },
    ),
    # DeepSeek-V3's shape: a query bottleneck, sigmoid scores with a correction bias chosen within the best 2 of 4
    # groups by their two best, renormalised and scaled; YaRN whose mscale and mscale_all_dim differ.
    "deepseek_v3": (
        "deepseek_v3",
        {
            "tie_word_embeddings": False,
            "head_dim": 8,
            "num_key_value_heads": 4,  # transformers expands the latent to every head
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "num_nextn_predict_layers": 0,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
        },
    ),
}


def make_config(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **{**COMMON, **overrides})


@torch.no_grad()
def randomize(model: PreTrainedModel, seed: int, std: float = 0.2) -> None:
    """Fixed-seed weights: matrices and biases N(0, std), embeddings N(0, 0.5), norm gains N(1, 0.2)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # a tied lm_head appears once, as embed_tokens
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if "embed_tokens" in name:
            param.copy_(0.5 * noise)
        elif name.endswith("self_attn.sinks"):  # gpt-oss: logits on the scores' scale, so that the sinks take a share
            param.copy_(1.0 + noise)
        elif param.ndim == 1 and name.endswith(".weight"):  # RMSNorm gains, q/k norms included
            param.copy_(1.0 + 0.2 * noise)
        else:  # projection matrices, lm_head, qkv biases
            param.copy_(std * noise)
    for name, buffer in model.named_buffers():  # DeepSeek-V3 / GLM-4.5 keep the router's correction bias here
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(std * torch.randn(buffer.shape, generator=gen, dtype=torch.float32))


def build_hf_model(model_type: str, overrides: dict, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = make_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    randomize(model, seed)
    return model.eval()


def as_reference(model: PreTrainedModel) -> HFReference:
    """A transformers model as the reference, set never to stop at an eos (our requests ignore it)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return HFReference(model.eval(), None)


def load_reference(folder: Path, **kwargs) -> HFReference:
    """The transformers model read back from `folder` (eager attention)."""
    return as_reference(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager", **kwargs)
    )


@dataclass
class TinyModel:
    name: str
    folder: Path
    reference: HFReference

    @property
    def vocab_size(self) -> int:
        return self.reference.model.config.vocab_size

    def llm(self, **kwargs) -> LLM:
        kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
        kwargs.setdefault("num_kv_blocks", 64)
        kwargs.setdefault("dtype", "float32")
        return LLM(model=str(self.folder), **kwargs)


def save_tiny(name: str, root: Path, seed: int = 0) -> TinyModel:
    model_type, overrides = SPECS[name]
    model = build_hf_model(model_type, overrides, seed)
    folder = root / name
    model.save_pretrained(folder, safe_serialization=True)
    return TinyModel(name, folder, load_reference(folder))


def prompts(seed: int, lengths: list[int], vocab: int = VOCAB) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def greedy_params(vocab: int, prompt_logprobs: bool = True, max_tokens: int = NEW_TOKENS) -> SamplingParams:
    """Greedy, with logprobs of the whole vocabulary (so they are full log-softmaxed logits)."""
    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=vocab,
        prompt_logprobs=vocab if prompt_logprobs else None,
    )


def run(llm: LLM, token_prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)


def _dense(entry: dict, vocab: int) -> torch.Tensor:
    assert len(entry) == vocab, f"expected logprobs of all {vocab} tokens, got {len(entry)}"
    return torch.tensor([entry[t].logprob for t in range(vocab)], dtype=torch.float32)


def check_output(
    label: str,
    output: RequestOutput,
    prompt: list[int],
    reference: HFReference,
    comparison: GreedyComparison,
    *,
    expect_prompt_logprobs: bool = True,
    max_tokens: int = NEW_TOKENS,
) -> float:
    """Checks one finished request against transformers; returns the largest relative logit error.

    1. Logits: transformers runs prompt + our generated tokens in one forward pass; our prompt logprobs
       and per-step logprobs must equal its log-softmax within LOGIT_RTOL * max|logits|.
    2. Greedy tokens: equal to transformers' `generate(do_sample=False)` up to a near-tie divergence.
    """
    vocab = reference.model.config.get_text_config().vocab_size
    completion = output.outputs[0]
    ours = list(completion.token_ids)
    assert output.prompt_token_ids == prompt
    assert len(ours) == max_tokens, f"{label}: {len(ours)} tokens ({completion.finish_reason})"

    ref_logits = reference.logits(prompt + ours[:-1])
    scale = float(ref_logits.abs().max())
    assert scale > 1.0, f"{label}: reference logits are too small ({scale}) for a meaningful comparison"
    ref_lp = torch.log_softmax(ref_logits, dim=-1)
    rows, mine = [], []
    if expect_prompt_logprobs:
        plp = output.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None, f"{label}: bad prompt_logprobs"
        for i in range(1, len(prompt)):
            assert prompt[i] in plp[i]
            rows.append(i - 1)
            mine.append(_dense(plp[i], vocab))
    assert completion.logprobs is not None and len(completion.logprobs) == len(ours)
    for j, (token, entry) in enumerate(zip(ours, completion.logprobs, strict=True)):
        dense = _dense(entry, vocab)
        assert dense[token] == dense.max(), f"{label}: token {j} is not the argmax of its own logprobs"
        rows.append(len(prompt) - 1 + j)
        mine.append(dense)
    error = float((torch.stack(mine) - ref_lp[rows]).abs().max())
    assert error <= LOGIT_RTOL * scale, (
        f"{label}: logprobs differ from transformers by {error:.3e} (tolerance {LOGIT_RTOL * scale:.3e})"
    )
    comparison.check(label, ours, reference.greedy(prompt, max_tokens))
    return error / scale


def check_served_choice(label: str, choice, prompt: list[int], tiny: TinyModel, new_tokens: int, comparison) -> None:
    """A completion choice (greedy, `logprobs=1`, tokens as ids) against transformers: its tokens up to a near-tie
    divergence, their logprobs within LOGIT_RTOL of the logit scale."""
    tokens = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert len(tokens) == new_tokens, choice
    comparison.check(label, tokens, tiny.reference.greedy(prompt, new_tokens))
    logits = tiny.reference.logits(prompt + tokens[:-1])[len(prompt) - 1 :]
    expected = torch.log_softmax(logits, -1)[torch.arange(new_tokens), torch.tensor(tokens)]
    error = (torch.tensor(choice.logprobs.token_logprobs) - expected).abs().max()
    assert error <= LOGIT_RTOL * logits.abs().max(), f"{label}: served logprobs differ by {error:.2e}"

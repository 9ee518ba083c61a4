"""A decoder-only model as data: its sizes, each layer's blocks (`LayerSpec`) and its checkpoint's layout.

The layer's order of operations is fixed (decoder.DecoderLayer):

    h = pre_norm(x) if pre_norms else x
    a = o_proj(attention(rotary(qk_norm(qkv_proj(h)))))          # scale, soft-cap and window from the spec
      or latent_attention(h)                                       # multi-head latent attention where it has `mla`
    x = x + residual_scale * (attn_output_norm(a) if output_norms else a)
    h = post_attention_norm(x) if pre_norms else x
    m = down_proj(act(gate) * up)                                  # silu (SwiGLU) or tanh GELU (GeGLU)
      or experts(h)                                                # a mixture of experts where the spec has `moe`
    x = x + residual_scale * (mlp_output_norm(m) if output_norms else m)

and every field of `LayerSpec` that differs from its default (Llama's) is a trait. The operator-by-operator layer
implements them all; a fused kernel or an exporter names the traits it implements, and `unimplemented_traits`
lists the rest, so a layer with a trait it lacks is refused rather than computed wrongly. What a family does that
a load-time transform can express (Gemma's `1 + w` norms, GLM's interleaved and partial rotary, fused checkpoint
projections) is done to the weights instead (model/loader/canonical_tensors.py) and is not a trait.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

ROTARY_GLOBAL, ROTARY_LOCAL, ROTARY_NONE = "global", "local", "none"


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP (model/moe.py): a router scores `num_experts` SwiGLU experts of
    `intermediate_size` for each token and the token's output is the weighted sum of its `top_k` best.

    Scores are the softmax of the router's logits (Mixtral, Qwen-MoE, ERNIE 4.5) or their sigmoid (DeepSeek-V3,
    GLM-4.5). Experts are chosen by score plus a per-expert `correction_bias` where the checkpoint has one; with
    `num_groups` > 1 only experts of the `top_groups` best groups compete (a group's score: the sum of its two best
    experts' scores). The chosen scores are the weights, divided by their sum where `renormalize`, then multiplied
    by `routed_scale`. Shared experts (one SwiGLU MLP of `shared_intermediate_size`) see every token, scaled by
    sigmoid(shared_gate(h)) where `shared_gate` (Qwen2-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str = "softmax"  # or "sigmoid"
    renormalize: bool = True
    correction_bias: bool = False
    num_groups: int = 1
    top_groups: int = 1
    routed_scale: float = 1.0
    group_score: str = "top2_sum"  # a group's score: its two best experts' sum, or its best ("max", DeepSeek-V2)
    shared_intermediate_size: int = 0  # 0: no shared experts
    shared_gate: bool = False
    router_bias: bool = False  # the router's logits have a bias (gpt-oss)
    expert_bias: bool = False  # the experts' projections have biases (gpt-oss)
    # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit, out = (up + 1) * gate * sigmoid(alpha * gate)
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    # With expert parallelism, the experts [first, last) this rank holds whole (None: every expert, or a slice of
    # each with tensor parallelism); the router still scores them all.
    local_experts: tuple[int, int] | None = None


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3, model/mla.py). Keys and values of every head are projections of
    one `kv_lora_rank` latent a token, which the KV cache holds with the token's rotary key (`qk_rope_head_dim`,
    shared by the heads); queries go through a `q_lora_rank` bottleneck where it is set."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's blocks; the defaults are Llama's."""

    sliding_window: int | None = None  # keys older than this many positions are masked out
    rotary: str = ROTARY_GLOBAL  # the model's rotary table this layer reads: global, local (Gemma 3's), none
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3, Gemma 3); "projection": over all heads (OLMo 2)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    attn_sinks: bool = False  # a learned logit per head joins each softmax and attends to nothing (gpt-oss)
    pre_norms: bool = True  # RMSNorm before attention and before the MLP (OLMo 2 has none)
    output_norms: bool = False  # RMSNorm on attention's and the MLP's outputs (Gemma 2/3's sandwich, GLM-4, OLMo 2)
    activation: str = "silu"  # of the gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    mlp_bias: bool = False
    residual_scale: float = 1.0  # sublayer outputs are scaled before the residual add (Granite)
    moe: MoESpec | None = None  # the MLP is a mixture of experts (with `activation`'s gate)
    mla: MLASpec | None = None  # the attention is multi-head latent attention

    def traits(self) -> dict[str, object]:
        """The fields that differ from their defaults, with their values."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


# A kernel's or exporter's implemented traits: name -> the values it implements (None: every value).
ImplementedTraits = dict[str, frozenset | None]


def unimplemented_traits(traits: dict[str, object], implemented: ImplementedTraits) -> list[str]:
    """The traits (as "name=value") that `implemented` does not cover; a trait added to LayerSpec is in this list
    for every implementation until it names it."""
    missing = []
    for name, value in traits.items():
        if name not in implemented or (implemented[name] is not None and value not in implemented[name]):
            missing.append(f"{name}={value}")
    return missing


@dataclass(frozen=True)
class RotarySpec:
    """A rotary table: frequencies for the first `rotary_dim` of each head's dimensions (the rest pass through),
    from the config's rope parameters for `layer_type` (Gemma 3 keeps one set per layer type; None: the only set)."""

    rotary_dim: int
    layer_type: str | None = None


@dataclass(frozen=True)
class CheckpointLayout:
    """How a family's checkpoint differs from Llama's names and layout; undone at load."""

    renames: tuple[tuple[str, str], ...] = ()  # (checkpoint's layer-tensor prefix, ours), applied in order
    fused_qkv: str | None = None  # the layer-tensor name of a fused q/k/v projection (Phi-3: self_attn.qkv_proj)
    fused_gate_up: str | None = None  # of a fused gate/up projection (Phi-3, GLM: mlp.gate_up_proj)
    norm_offset: bool = False  # norms scale by 1 + w (Gemma): 1 is added to every norm weight
    interleaved_rotary: bool = False  # rotary pairs are adjacent dimensions (GLM, ERNIE): q/k rows are reordered
    # An expert's gate, up and down projections under the checkpoint's names (Mixtral: w1, w3, w2)
    expert_projections: tuple[str, str, str] | None = None
    extra_layers: int = 0  # multi-token-prediction layers stored after the model's own (GLM-4.5): skipped
    # Experts stored as one stack a layer, input-major with gate and up columns interleaved (gpt-oss:
    # mlp.experts.gate_up_proj [E, hidden, 2I], down_proj [E, I, hidden] and their biases): split per expert
    stacked_experts: bool = False


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    layers: tuple[LayerSpec, ...]
    rotary: dict[str, RotarySpec]  # the tables the layers read, by LayerSpec.rotary
    attn_scale: float  # multiplies q.k (head_dim ** -0.5 unless the family sets it)
    embed_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(hidden); Granite)
    logits_scale: float = 1.0  # the LM head's output is multiplied by it (Granite: 1 / logits_scaling)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    checkpoint: CheckpointLayout = CheckpointLayout()
    # Why the context may not exceed max_position_embeddings (None: it may, with a warning).
    context_limit: str | None = None
    # The V cache is the K cache's first dimensions (latent attention: num_kv_heads 1, head_dim the latent and the
    # rotary key), so the KV cache holds one tensor a layer instead of two.
    values_in_keys: bool = False

    @classmethod
    def from_hf_config(cls, config) -> ModelArch:
        """The decoder of a text model, or the language model of a vision-language one."""
        from heteroserve.model.families import arch_of

        return arch_of(config)

    def model_traits(self) -> dict[str, object]:
        """The model-level steps that differ from Llama's (outside the layers)."""
        traits = {"embed_scale": self.embed_scale, "logits_scale": self.logits_scale}
        traits = {k: v for k, v in traits.items() if v != 1.0}
        if self.final_softcap is not None:
            traits["final_softcap"] = self.final_softcap
        return traits

    @property
    def sliding_windows(self) -> list[int | None]:
        """The distinct windows of the layers, full attention (None) first, then the windows from the smallest: the
        order of the KV groups (one per window) and of a step's block tables. It depends on the set of windows
        only, so every pipeline stage of a model that holds the same windows orders them alike; a stage's share
        of the model keeps the whole model's list (ModelShard), whichever of its windows its layers use."""
        windows = {layer.sliding_window for layer in self.layers}
        return ([None] if None in windows else []) + sorted(w for w in windows if w is not None)

    @property
    def rotary_head_dim(self) -> int:
        """The width of the dimensions the rotary tables rotate: a head's, or latent attention's rotary key's."""
        mla = self.layers[0].mla if self.layers else None
        return mla.qk_rope_head_dim if mla is not None else self.head_dim

    def qk_row_order(self) -> torch.Tensor | None:
        """The order our q/k projection rows take within each head (row j reads the checkpoint's row order[j]), so
        that the table's rotate-half rotary computes the family's: rotated pairs (i, i + rotary_dim / 2), or
        adjacent (2i, 2i + 1) where the checkpoint interleaves them, sit at (i, i + head_dim / 2), and the
        dimensions that pass through fill the columns whose frequency is zero. None where it is the identity."""
        d = self.rotary_head_dim
        dims = {spec.rotary_dim for spec in self.rotary.values() if spec.rotary_dim}
        if len(dims) > 1:
            raise ValueError(f"rotary tables of different dimensions {sorted(dims)} cannot share one q/k row order")
        rot = dims.pop() if dims else d
        if rot == d and not self.checkpoint.interleaved_rotary:
            return None
        half = rot // 2
        if self.checkpoint.interleaved_rotary:
            first, second = list(range(0, rot, 2)), list(range(1, rot, 2))
        else:
            first, second = list(range(half)), list(range(half, rot))
        passing = list(range(rot, d))
        fill = (d - rot) // 2
        return torch.tensor(first + passing[:fill] + second + passing[fill:])

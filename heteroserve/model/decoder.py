"""One decoder-only transformer for every supported architecture; the differences are in `ModelArch` (arch.py
gives the layer's order of operations, families.py each family's blocks).

Tokens from all scheduled requests arrive flattened ([T] ids and positions), so each projection is one
matrix product over the whole step. Query/key/value and gate/up projections are fused at load time.
Every operator (projections, norms, rotary, activation) comes from the platform's `OperatorTable` and
attention from its `AttentionBackend`, so a device changes kernels without touching this file.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from heteroserve.distributed.parallel_state import ParallelGroups
from heteroserve.model.arch import ROTARY_GLOBAL, LayerSpec, ModelArch
from heteroserve.model.layers.norm import RMSNorm
from heteroserve.model.layers.parameters import empty_vector, empty_weight
from heteroserve.model.layers.rotary import MRotaryEmbedding, RotaryEmbedding, rotary_embedding
from heteroserve.model.mla import LatentAttention
from heteroserve.model.moe import MoEBlock
from heteroserve.model.sharding import ModelShard
from heteroserve.platforms.attention import AttentionBackend, ScoreModifiers
from heteroserve.platforms.operators import DecodeLayerWeights, FusedDecodeLayer, OperatorTable
from heteroserve.platforms.paged_attention import PagedAttentionBackend

if TYPE_CHECKING:
    from heteroserve.lora.batch import LoRABatch


def _tensors_of(weight) -> list[torch.Tensor]:
    """The tensors inside a compressed weight object (a dataclass of tensors, possibly nested)."""
    found = []
    for field in dataclasses.fields(weight):
        value = getattr(weight, field.name)
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif dataclasses.is_dataclass(value):
            found += _tensors_of(value)
    return found


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of the memory holding `tensor`; oneDNN's packed tensors expose no storage."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(tensor), tensor.numel() * tensor.element_size()


def stored_weight_bytes(model: nn.Module) -> int:
    """Bytes of all of a model's weights as stored (compressed ones at their compressed size), each storage counted
    once: a tied LM head may read the embedding's own tensors."""
    tensors = list(model.parameters())
    for module in model.modules():
        listed = [v for value in vars(module).values() if isinstance(value, list) for v in value]
        tensors += [v for v in listed if isinstance(v, torch.Tensor)]  # a MoE block's expert weights
        values = [*vars(module).values(), *listed]
        compressed = [v for v in values if hasattr(v, "nbytes") and not isinstance(v, torch.Tensor)]
        tensors += [t for value in compressed for t in _tensors_of(value)]
    return sum(dict(_storage(t) for t in tensors).values())


class Attention(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        spec: LayerSpec,
        ops: OperatorTable,
        parallel: ParallelGroups,
        backend: AttentionBackend,
        index: int,
    ) -> None:
        super().__init__()
        self.index = index
        self.spec = spec
        self.ops = ops
        self.backend = backend
        self.parallel = parallel
        self.linear = ops.linear
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = empty_weight(self.q_size + 2 * self.kv_size, arch.hidden_size)
        self.qkv_bias = empty_vector(self.q_size + 2 * self.kv_size) if spec.qkv_bias else None
        self.o_proj = empty_weight(arch.hidden_size, self.q_size)
        self.o_bias = empty_vector(arch.hidden_size) if spec.o_bias else None
        q_norm_size, k_norm_size = {"head": (self.head_dim,) * 2, "projection": (self.q_size, self.kv_size)}.get(
            spec.qk_norm, (0, 0)
        )
        self.q_norm = RMSNorm(q_norm_size, arch.rms_norm_eps, ops) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_norm_size, arch.rms_norm_eps, ops) if spec.qk_norm else None
        self.scale = arch.attn_scale
        self.sinks = empty_vector(self.num_heads) if spec.attn_sinks else None
        modified = [name for name, on in (("logit soft-capping", spec.attn_softcap), ("sinks", spec.attn_sinks)) if on]
        if modified and not backend.implements_score_modifiers:
            raise ValueError(
                f"the {backend.name} attention backend does not implement {' and '.join(modified)}, which this "
                f"model's layer {index} uses"
            )

    def score_modifiers(self) -> ScoreModifiers | None:
        """What the layer does to its scores besides scale and mask (read per call: the sinks are loaded later)."""
        if self.spec.attn_softcap is None and self.sinks is None:
            return None
        return ScoreModifiers(self.spec.attn_softcap, None if self.sinks is None else self.sinks.data)

    def projections(self) -> list[str]:
        """The names of this block's weights that go through the platform's linear op."""
        return ["qkv_proj", "o_proj"]

    def forward(self, x, positions, rotary, kv_cache, meta, lora: LoRABatch | None) -> torch.Tensor:
        qkv = self.linear(x, self.qkv_proj, self.qkv_bias)
        if lora is not None:
            qkv = lora.add(qkv, x, self.index, "qkv")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.spec.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.spec.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        modifiers = self.score_modifiers()  # passed only where the layer has some: a backend may not take them
        extra = {} if modifiers is None else {"modifiers": modifiers}
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, **extra)
        out = out.flatten(1)
        y = self.linear(out, self.o_proj)
        if lora is not None:
            y = lora.add(y, out, self.index, "o")
        y = self.parallel.all_reduce(y)
        return y if self.o_bias is None else y + self.o_bias


class DecoderLayer(nn.Module):
    """The layer of arch.py's order of operations, with `spec`'s blocks. index: the layer's place in the model
    (where LoRA adapters keep its matrices)."""

    def __init__(
        self,
        arch: ModelArch,
        spec: LayerSpec,
        ops: OperatorTable,
        parallel: ParallelGroups,
        backend: AttentionBackend,
        index: int,
        expert_ops: OperatorTable | None = None,
    ) -> None:
        super().__init__()
        self.index = index
        self.spec = spec
        self.backend = backend
        self.ops = ops
        self.linear = ops.linear
        self.parallel = parallel
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.eps = eps
        self.input_layernorm = RMSNorm(h, eps, ops) if spec.pre_norms else None
        self.post_attention_layernorm = RMSNorm(h, eps, ops) if spec.pre_norms else None
        self.attn_output_norm = RMSNorm(h, eps, ops) if spec.output_norms else None
        self.mlp_output_norm = RMSNorm(h, eps, ops) if spec.output_norms else None
        if spec.mla is None:
            self.self_attn = Attention(arch, spec, ops, parallel, backend, index)
        else:
            self.self_attn = LatentAttention(arch, spec, ops, parallel, backend, index, arch.attn_scale)
        self.activation = {"silu": ops.silu_and_mul, "gelu_tanh": ops.gelu_tanh_and_mul}[spec.activation]
        dense = spec.moe is None
        if not dense and spec.mlp_bias:
            raise ValueError(f"layer {index}: a mixture-of-experts MLP with biases is not implemented")
        self.moe = None if dense else MoEBlock(spec.moe, h, ops, spec.activation, expert_ops)
        self.gate_up_proj = empty_weight(2 * arch.intermediate_size, h) if dense else None
        self.gate_up_bias = empty_vector(2 * arch.intermediate_size) if spec.mlp_bias else None
        self.down_proj = empty_weight(h, arch.intermediate_size) if dense else None
        self.down_bias = empty_vector(h) if spec.mlp_bias else None
        self.fused_decode: FusedDecodeLayer | None = None  # the platform's one-call layer for decode-only steps

    def fuse_for_decode(self, rotary: RotaryEmbedding, tp_size: int) -> None:
        """Binds the platform's fused decode layer to this layer's prepared weights, where it has one that
        implements all of this layer's traits (the fuser answers None otherwise)."""
        attn = self.self_attn
        moe = self.moe if self.moe is not None and not self.moe.experts_on_host else None
        self.fused_decode = self.ops.fuse_decode_layer(
            DecodeLayerWeights(
                input_norm=self.input_layernorm.weight.data if self.input_layernorm is not None else None,
                qk_norms=None if attn.q_norm is None else (attn.q_norm.weight.data, attn.k_norm.weight.data),
                qkv=attn.qkv_proj,
                qkv_bias=None if attn.qkv_bias is None else attn.qkv_bias.data,
                o_proj=attn.o_proj,
                post_norm=self.post_attention_layernorm.weight.data if self.post_attention_layernorm else None,
                gate_up=self.gate_up_proj,
                down=self.down_proj,
                eps=self.eps,
                num_heads=attn.num_heads,
                scale=attn.scale,
                cos=rotary.cos,
                sin=rotary.sin,
                traits=self.spec.traits(),
                multimodal_rope=isinstance(rotary, MRotaryEmbedding),
                tensor_parallel_size=tp_size,
                experts=None if moe is None else moe.fused_experts,
                shared_gate_up=None if moe is None else moe.shared_gate_up,
                shared_down=None if moe is None else moe.shared_down,
                shared_gate=None if moe is None or moe.shared_gate is None else moe.shared_gate.data,
            )
        )

    def forward(self, x, positions, rotary, kv_cache, meta, lora: LoRABatch | None = None) -> torch.Tensor:
        """meta: the attention metadata of this layer's window; lora: the step's adapter rows (their products are
        added by the fused layer where it takes them, else by the operator-by-operator layer)."""
        if self.fused_decode is not None and self.backend.is_decode_only(meta):
            if lora is None:
                return self.fused_decode(x, positions, kv_cache[0], kv_cache[1], meta)
            if getattr(self.fused_decode, "takes_lora", False):
                adapters = (lora.layer_matrices(self.index), lora.rows.segments)
                return self.fused_decode(x, positions, kv_cache[0], kv_cache[1], meta, adapters)
        spec = self.spec
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        a = self.self_attn(h, positions, rotary, kv_cache, meta, lora)
        if self.attn_output_norm is not None:
            a = self.attn_output_norm(a)
        x = x + a if spec.residual_scale == 1.0 else x + a * spec.residual_scale
        h = self.post_attention_layernorm(x) if self.post_attention_layernorm is not None else x
        m = self.parallel.all_reduce(self.moe(h) if self.moe is not None else self._dense_mlp(h, lora))
        if self.down_bias is not None:
            m = m + self.down_bias
        if self.mlp_output_norm is not None:
            m = self.mlp_output_norm(m)
        return x + m if spec.residual_scale == 1.0 else x + m * spec.residual_scale

    def _dense_mlp(self, h: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """The rank's partial MLP output (before the all-reduce and the bias)."""
        gate_up = self.linear(h, self.gate_up_proj, self.gate_up_bias)
        if lora is not None:
            gate_up = lora.add(gate_up, h, self.index, "gate_up")
        act = self.activation(gate_up)
        down = self.linear(act, self.down_proj)
        if lora is not None:
            down = lora.add(down, act, self.index, "down")
        return down


class DecoderModel(nn.Module):
    """With a `ModelShard`, the rank's part of the model: `arch` holds its local sizes (see distributed/).
    lm_head=False: an embedding model's decoder (its hidden states are pooled), with no LM head to load or prepare.
    attn_backend: the platform's (`Platform.get_attn_backend`); the runner builds each step's metadata with it.
    expert_ops: the CPU platform's operators where a mixture of experts' routed experts stay in host memory
    (--moe-experts-device cpu; None: they run with the rest)."""

    def __init__(
        self,
        arch: ModelArch,
        hf_config: PretrainedConfig,
        max_positions: int,
        ops: OperatorTable,
        shard: ModelShard | None = None,
        lm_head: bool = True,
        attn_backend: AttentionBackend | None = None,
        expert_ops: OperatorTable | None = None,
    ) -> None:
        super().__init__()
        self.shard = shard or ModelShard.whole(arch)
        self.parallel = self.shard.groups
        self.arch = self.shard.arch
        arch = self.arch
        self.ops = ops
        self.linear = self.ops.linear
        self.embed_tokens = nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size), requires_grad=False)
        self.attn_backend = attn_backend or PagedAttentionBackend(ops)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, spec, self.ops, self.parallel, self.attn_backend, i, expert_ops)
            for i, spec in enumerate(arch.layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, self.ops)
        self.has_lm_head = lm_head
        self.lm_head = (
            None if arch.tie_word_embeddings or not lm_head else empty_weight(arch.vocab_size, arch.hidden_size)
        )
        text_config = hf_config.get_text_config()
        self.rotaries = nn.ModuleDict(
            {
                kind: rotary_embedding(text_config, spec, arch.rotary_head_dim, max_positions, self.ops)
                for kind, spec in arch.rotary.items()
            }
        )
        self.rotary = self.rotaries[ROTARY_GLOBAL]

    def prepare_weights(self) -> None:
        """Hands every projection weight to the linear kernel once (repacking); call after loading."""
        for layer in self.layers:
            attn = layer.self_attn
            projections = [(attn, name) for name in attn.projections()] + [
                (layer, "gate_up_proj"),
                (layer, "down_proj"),
            ]
            if layer.moe is not None:
                projections += [(layer.moe, "shared_gate_up"), (layer.moe, "shared_down")]
                layer.moe.prepare_experts(layer.moe.expert_linear.prepare)
            for owner, name in projections:
                if getattr(owner, name) is not None:
                    self._prepare(owner, name, getattr(owner, name))
            if isinstance(attn, LatentAttention):
                attn.absorb()
        if self.has_lm_head:
            head = self.embed_tokens if self.lm_head is None else self.lm_head
            # A tied head gets its own prepared copy: the embedding lookup needs the plain layout.
            self._prepare(self, "lm_head", head, self.linear.prepare_lm_head)
        if self.ops.fuse_decode_layer is not None:
            for layer in self.layers:
                layer.fuse_for_decode(self.rotaries[layer.spec.rotary], self.parallel.tp_size)

    def _prepare(self, owner: nn.Module, name: str, weight, prepare=None) -> None:
        prepare = prepare or self.linear.prepare
        prepared = prepare(weight.data if isinstance(weight, torch.Tensor) else weight)
        owner._parameters.pop(name, None)
        if isinstance(prepared, torch.Tensor):
            setattr(owner, name, nn.Parameter(prepared, requires_grad=False))
        else:  # a compressed weight object (heteroserve.quantization), kept as a plain attribute
            setattr(owner, name, prepared)

    def weight_bytes(self) -> int:
        """Bytes of all weights as stored (stored_weight_bytes)."""
        return stored_weight_bytes(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: dict[int | None, object],
        injected: tuple[torch.Tensor, torch.Tensor] | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """The final hidden states; a pipeline stage before the last sends its output on instead.

        positions: [T], or [3, T] for M-RoPE. meta: the attention backend's metadata for the step (its
        `build_metadata`) for each of `arch.sliding_windows`, by window.
        injected: (rows, features [n, 1 + k, hidden]) for image placeholder tokens:
        features[:, 0] replaces their token embeddings, features[:, i] (DeepStack, Qwen3-VL) is added to their
        hidden states after decoder layer i - 1. lora: the step's rows under LoRA adapters (LoRABatch)."""
        dtype = self.norm.weight.dtype
        if self.parallel.is_first_stage:
            x = self.embed(input_ids)
        else:
            x = self.parallel.recv_hidden((len(input_ids), self.arch.hidden_size), dtype, input_ids.device)
        if injected is not None:
            rows, features = injected
            x[rows] = features[:, 0].to(x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            spec = layer.spec
            x = layer(x, positions, self.rotaries[spec.rotary], kv_cache, meta[spec.sliding_window], lora)
            if injected is not None and i + 1 < features.shape[1]:
                x[rows] += features[:, i + 1].to(x.dtype)
        if not self.parallel.is_last_stage:
            self.parallel.send_hidden(x)
            return x
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; with tensor parallelism each rank looks up its vocabulary rows and the sum joins them."""
        ids = input_ids
        if self.parallel.tp_size > 1:
            local = input_ids - self.shard.vocab_start
            inside = (local >= 0) & (local < self.arch.vocab_size)
            ids = torch.where(inside, local, 0)
        if isinstance(self.embed_tokens, torch.Tensor):
            x = F.embedding(ids, self.embed_tokens)
        else:  # an 8-bit embedding dequantises just the rows looked up
            x = self.embed_tokens.rows(ids).to(self.norm.weight.dtype)
        if self.parallel.tp_size > 1:
            x = self.parallel.all_reduce(x * inside[:, None].to(x.dtype))
        if self.arch.embed_scale != 1.0:  # in the activations' dtype, as the reference models round it
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits for the given rows only (the LM head runs just where tokens are sampled).
        With tensor parallelism they are gathered on the sampling rank; the other ranks get None."""
        if not self.has_lm_head:
            raise RuntimeError("this decoder was built for embeddings, without an LM head")
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = self.parallel.gather_vocab(self.linear(hidden, head).float(), self.shard.full_arch.vocab_size)
        if logits is None:
            return None
        if self.arch.logits_scale != 1.0:
            logits = logits * self.arch.logits_scale
        if self.arch.final_softcap is not None:
            logits = self.arch.final_softcap * torch.tanh(logits / self.arch.final_softcap)
        return logits

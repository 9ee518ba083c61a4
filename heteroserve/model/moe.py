"""A mixture-of-experts MLP block (arch.MoESpec): the router, the routed experts and the shared ones.

The step's tokens are grouped by expert, and each expert that any token chose runs once, as one product over its
tokens' rows: at decode only the chosen experts' weights are read. Each token's output adds its experts' weighted
outputs in the order of the experts' indices, whatever else is in the step, so a token's result does not depend
on how the step was batched (the projections themselves give the same bits at every row count). Nothing is
dropped: every token gets all of its `top_k` experts.

With tensor parallelism each rank holds a slice of every expert's (and the shared experts') intermediate rows;
the block returns the rank's partial sum, which the layer all-reduces with the rest.

Beside an accelerator the router and the routed experts may stay in host memory (`--moe-experts-device cpu`, as
llama.cpp's --cpu-moe and KTransformers place them): they run on the CPU platform's operators, the step's hidden
states cross to the host once and the routed experts' sum comes back once, and the shared experts run on the device
with the rest of the layer.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from heteroserve.model.arch import MoESpec
from heteroserve.model.layers.parameters import empty_vector, empty_weight
from heteroserve.platforms.operators import FusedExperts, OperatorTable


def route(
    logits: torch.Tensor, spec: MoESpec, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k]) of each token, from its float32 router logits."""
    scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if spec.num_groups > 1:
        grouped = choice.view(len(choice), spec.num_groups, -1)
        if spec.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(spec.top_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    ids = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    if spec.routed_scale != 1.0:
        weights = weights * spec.routed_scale
    return weights, ids


# What stays in host memory when the routed experts run on the CPU (placement.place_on leaves these attributes).
ROUTED_ATTRIBUTES = frozenset(
    {
        "router",
        "router_bias",
        "correction_bias",
        "experts_gate_up",
        "experts_down",
        "experts_gate_up_bias",
        "experts_down_bias",
    }
)


class MoEBlock(nn.Module):
    """The experts of one layer. Expert e's fused gate/up projection is `experts_gate_up[e]` and its down
    projection `experts_down[e]` (plain tensors, or whatever the platform's linear op prepared them into).

    activation: the operator name of the experts' activation ("silu", "gelu_tanh"); host_ops: the CPU platform's
    operators where the router and routed experts stay in host memory (None: they run with the rest)."""

    def __init__(
        self, spec: MoESpec, hidden_size: int, ops: OperatorTable, activation: str, host_ops: OperatorTable | None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.linear = ops.linear  # the shared experts'
        self.activation = _activation(ops, activation)
        self.expert_ops = expert_ops = host_ops or ops
        self.expert_linear = expert_ops.linear
        self.expert_activation = _activation(expert_ops, activation)
        self.activation_name = activation
        self.fused_experts: FusedExperts | None = None  # the platform's one-call kernel for the routed experts
        self.stays_on_host = ROUTED_ATTRIBUTES if host_ops is not None else frozenset()
        self.host_crossings = 0  # forwards that sent hidden states to the host experts and their sum back
        self.host_dtype: torch.dtype | None = None  # the host experts' activations where not the model's
        inter = spec.intermediate_size
        self.router = empty_weight(spec.num_experts, hidden_size)  # float32: routing is computed in float32
        self.router_bias = empty_vector(spec.num_experts) if spec.router_bias else None
        self.correction_bias = empty_vector(spec.num_experts) if spec.correction_bias else None
        self.first_expert, last = spec.local_experts or (0, spec.num_experts)
        self.experts_gate_up: list = [empty_weight(2 * inter, hidden_size) for _ in range(self.first_expert, last)]
        self.experts_down: list = [empty_weight(hidden_size, inter) for _ in range(self.first_expert, last)]
        biased = range(self.first_expert, last) if spec.expert_bias else range(0)
        self.experts_gate_up_bias: list = [torch.empty(2 * inter) for _ in biased]
        self.experts_down_bias: list = [torch.empty(hidden_size) for _ in biased]
        if spec.swiglu_limit is not None:
            self.activation = functools.partial(clamped_swiglu, limit=spec.swiglu_limit, alpha=spec.swiglu_alpha)
            self.expert_activation = self.activation
        shared = spec.shared_intermediate_size
        self.shared_gate_up = empty_weight(2 * shared, hidden_size) if shared else None
        self.shared_down = empty_weight(hidden_size, shared) if shared else None
        self.shared_gate = empty_weight(1, hidden_size) if spec.shared_gate else None

    def prepare_experts(self, prepare) -> None:
        """Hands every routed expert's projections to the linear kernel once (the shared experts are the layer's
        projections: DecoderModel.prepare_weights prepares them with the others)."""
        self.experts_gate_up = [
            prepare(w.data) if isinstance(w, torch.Tensor) else prepare(w) for w in self.experts_gate_up
        ]
        self.experts_down = [prepare(w.data) if isinstance(w, torch.Tensor) else prepare(w) for w in self.experts_down]
        fuser = self.expert_ops.fuse_experts
        plain = not self.spec.expert_bias and self.spec.swiglu_limit is None
        if fuser is not None and plain:
            self.fused_experts = fuser(
                self.experts_gate_up,
                self.experts_down,
                self.activation_name,
                self.first_expert,
                self.router.data,
                self.router_bias,
                self.spec,
                None if self.correction_bias is None else self.correction_bias.data,
            )

    @property
    def experts_on_host(self) -> bool:
        return bool(self.stays_on_host)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.experts_on_host:
            self.host_crossings += 1
            out = self._routed(h.to("cpu", self.host_dtype or h.dtype)).to(h.device)
        else:
            out = self._routed(h)
        if self.shared_gate_up is not None:
            shared = self._mlp(h, self.shared_gate_up, self.shared_down).float()
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(F.linear(h, self.shared_gate)).float()
            out += shared
        return out.to(h.dtype)

    def _routed(self, h: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for each row of `h`, in float32 on h's device."""
        if self.fused_experts is not None:
            weights, ids = self.fused_experts.route(h)
        else:
            logits = F.linear(h.float(), self.router, self.router_bias)
            weights, ids = route(logits, self.spec, self.correction_bias)
        return self._experts(h, ids, weights)

    def _experts(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each row's weighted sum of its chosen experts (`ids`, `weights`: [T, top_k]), in float32."""
        if self.fused_experts is not None:
            return self.fused_experts(h, ids, weights)
        spec = self.spec
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens ascending in each
        counts = torch.bincount(flat, minlength=spec.num_experts).tolist()
        token_of = order // spec.top_k
        first, last = self.first_expert, self.first_expert + len(self.experts_down)
        begin, end = sum(counts[:first]), sum(counts[:last])  # this rank's experts' share of the pairs
        token_of, order = token_of[begin:end], order[begin:end]
        rows = h[token_of]
        outputs, start = [], 0
        for local, count in enumerate(counts[first:last]):
            if count:
                part = rows[start : start + count]
                biases = (self.experts_gate_up_bias[local], self.experts_down_bias[local]) if spec.expert_bias else ()
                outputs.append(self._expert(part, self.experts_gate_up[local], self.experts_down[local], *biases))
                start += count
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        if outputs:
            weighted = torch.cat(outputs).float() * weights.flatten()[order, None]
            # index_add_ adds a token's rows in their order here: its experts by ascending index, whatever the batch.
            out.index_add_(0, token_of, weighted)
        return out

    def _expert(self, x: torch.Tensor, gate_up, down, gate_up_bias=None, down_bias=None) -> torch.Tensor:
        linear = self.expert_linear
        return linear(self.expert_activation(linear(x, gate_up, gate_up_bias)), down, down_bias)

    def _mlp(self, x: torch.Tensor, gate_up, down) -> torch.Tensor:
        return self.linear(self.activation(self.linear(x, gate_up)), down)


def _activation(ops: OperatorTable, name: str):
    return {"silu": ops.silu_and_mul, "gelu_tanh": ops.gelu_tanh_and_mul}[name]


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation of a fused [gate | up] row: (up + 1) * gate * sigmoid(alpha * gate) with the gate capped
    at `limit` and up clamped to [-limit, limit]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)

"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision tower: patch embedding, transformer blocks, patch merger.

Runs once per image at prefill and returns, for each image placeholder token, its embedding and (Qwen3-VL's
DeepStack) the extra features added after the first decoder layers. Parameter names follow the
checkpoint's (`visual.*`, Qwen3-VL's renamed in loading.py), so loading is a `load_state_dict`.

Patches arrive in the image processor's order: within each frame, merge_size x merge_size blocks of
neighbouring patches are consecutive, so the merger concatenates each run of merge_size**2 rows.
Qwen2.5-VL's window attention: the rows are sorted by window once (a window holds whole merge blocks),
windowed blocks attend within each run of rows, full blocks over all of them (order does not matter
there), and the rows go back to placeholder order before the merger.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from heteroserve.model.vision.spec import VisionSpec


def _norm(spec: VisionSpec, size: int) -> nn.Module:
    return nn.RMSNorm(size, eps=1e-6) if spec.rms_norm else nn.LayerNorm(size, eps=1e-6)


class PatchEmbed(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.in_channels, spec.embed_dim, kernel, stride=kernel, bias=spec.patch_bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches: [N, C * T * P * P] flattened as the processor does; a stride-equals-kernel conv is a matmul."""
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.act = ACT2FN[spec.activation]
        self.gated = spec.gated_mlp
        if self.gated:
            self.gate_proj = nn.Linear(spec.embed_dim, spec.mlp_dim)
            self.up_proj = nn.Linear(spec.embed_dim, spec.mlp_dim)
            self.down_proj = nn.Linear(spec.mlp_dim, spec.embed_dim)
        else:
            self.fc1 = nn.Linear(spec.embed_dim, spec.mlp_dim)
            self.fc2 = nn.Linear(spec.mlp_dim, spec.embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary in float32, as the reference vision tower does it."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.qkv = nn.Linear(spec.embed_dim, 3 * spec.embed_dim)
        self.proj = nn.Linear(spec.embed_dim, spec.embed_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, windows: list[int] | None):
        """windows: sizes of consecutive row runs that attend only among themselves; None: all rows together."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, head_dim]: the fused kernel
        if windows is None:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            parts = zip(*(t.split(windows, dim=2) for t in (q, k, v)), strict=True)
            out = torch.cat([F.scaled_dot_product_attention(*part) for part in parts], dim=2)
        return self.proj(out[0].transpose(0, 1).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1 = _norm(spec, spec.embed_dim)
        self.norm2 = _norm(spec, spec.embed_dim)
        self.attn = VisionAttention(spec)
        self.mlp = VisionMLP(spec)

    def forward(self, x, cos, sin, windows) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, windows)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge_size**2 neighbouring patches -> one token; DeepStack's mergers normalise after concatenating."""

    def __init__(self, spec: VisionSpec, norm_after_merge: bool = False) -> None:
        super().__init__()
        self.merged_dim = spec.embed_dim * spec.merge_size**2
        self.norm_after_merge = norm_after_merge
        self.ln_q = _norm(spec, self.merged_dim if norm_after_merge else spec.embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(), nn.Linear(self.merged_dim, spec.out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_after_merge:
            return self.mlp(self.ln_q(x.reshape(-1, self.merged_dim)))
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


class VisionEncoder(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)
        if spec.num_position_embeddings:
            self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.embed_dim)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(spec, True) for _ in spec.deepstack_blocks)
        quarter = spec.head_dim // 2
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def tokens_per_image(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.spec.merge_size**2

    def _merge_order(self, t: int, h: int, w: int) -> torch.Tensor:
        """[t*h*w, 2] (row, column) of every patch, in the processor's block-major order."""
        m = self.spec.merge_size
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        grid = torch.stack((rows, cols), dim=-1).view(h // m, m, w // m, m, 2).permute(0, 2, 1, 3, 4)
        return grid.reshape(-1, 2).repeat(t, 1)

    def _window_order(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int]] | None:
        """Rows sorted by (frame, window) and the window sizes in that order: Qwen2.5-VL's windowed blocks."""
        units = self.spec.window_units
        if units is None:
            return None
        m = self.spec.merge_size
        rc = self._merge_order(1, h, w) // m  # merged-token row and column of each patch
        per_frame = (rc[:, 0] // units) * (w // m) + rc[:, 1] // units
        window = torch.arange(t).repeat_interleave(h * w) * (h * w) + per_frame.repeat(t)
        order = torch.argsort(window, stable=True)
        sizes = torch.unique_consecutive(window[order], return_counts=True)[1]
        return order, sizes.tolist()

    def _learned_positions(self, positions: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Qwen3-VL: the square table resized to h x w (bilinear, corners aligned), read at each patch."""
        side = int(self.spec.num_position_embeddings**0.5)
        table = self.pos_embed.weight.float().T.reshape(1, -1, side, side)
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [C, h, w]
        return grid[:, positions[:, 0], positions[:, 1]].T

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t*h*w, C*T*P*P] -> [t*h*w / merge**2, 1 + len(deepstack_blocks), out_dim]:
        each placeholder token's embedding, then its DeepStack features in decoder-layer order."""
        t, h, w = grid_thw
        device = self.inv_freq.device
        x = self.patch_embed(pixel_values.to(device))
        positions = self._merge_order(t, h, w).to(device)
        if self.spec.num_position_embeddings:
            x = x + self._learned_positions(positions, h, w).to(x.dtype)
        freqs = (positions[..., None].float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]: rows, then columns
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        windows, restore = None, None
        window_order = self._window_order(t, h, w)
        if window_order is not None:
            order, windows = window_order
            order = order.to(device)
            restore = torch.argsort(order)
            x, cos, sin = x[order], cos[order], sin[order]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if i in self.spec.full_attention_blocks else windows)
            if i in self.spec.deepstack_blocks:
                merger = self.deepstack_merger_list[self.spec.deepstack_blocks.index(i)]
                deepstack.append(merger(x if restore is None else x[restore]))
        if restore is not None:
            x = x[restore]
        return torch.stack([self.merger(x), *deepstack], dim=1)

"""A Qwen-VL vision tower as a graph for one image grid: pixel patches in, the placeholder tokens' embeddings out.

Everything the encoder derives from the grid (patch positions, their rotary angles, Qwen3-VL's resized position
table, Qwen2.5-VL's window order and sizes) is computed here once, outside tracing, so the graph holds it as
constants and every shape is static: one graph per image grid, as compilers that need static shapes take it.
The blocks and mergers are the encoder's own modules.
"""

from __future__ import annotations

import torch
from torch import nn

from heteroserve.model.vision.encoder import VisionEncoder


def check_grid(encoder: VisionEncoder, grid: tuple[int, int, int]) -> None:
    t, h, w = grid
    m = encoder.spec.merge_size
    if h % m or w % m:
        raise ValueError(f"--vision-grid {t},{h},{w}: height and width must be multiples of {m} (the merge size)")


class VisionGraph(nn.Module):
    def __init__(self, encoder: VisionEncoder, grid: tuple[int, int, int]) -> None:
        super().__init__()
        check_grid(encoder, grid)
        t, h, w = grid
        spec = encoder.spec
        self.encoder = encoder
        self.num_patches = t * h * w
        self.patch_features = encoder.patch_embed.proj.weight[0].numel()
        with torch.no_grad():
            positions = encoder._merge_order(t, h, w)
            learned = encoder._learned_positions(positions, h, w) if spec.num_position_embeddings else None
            freqs = (positions[..., None].float() * encoder.inv_freq.cpu()).flatten(1)
            angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
            cos, sin = angles.cos(), angles.sin()
            window_order = encoder._window_order(t, h, w)
        self.windows = None
        self.register_buffer("order", None)
        self.register_buffer("restore", None)
        if window_order is not None:
            order, self.windows = window_order
            self.register_buffer("order", order)
            self.register_buffer("restore", torch.argsort(order))
            cos, sin = cos[order], sin[order]
        self.register_buffer("learned_positions", learned)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[t*h*w, C*T*P*P] patches -> [tokens, 1 + deepstack, out_dim], as VisionEncoder.forward returns."""
        encoder, spec = self.encoder, self.encoder.spec
        x = encoder.patch_embed(pixel_values)
        if self.learned_positions is not None:
            x = x + self.learned_positions.to(x.dtype)
        if self.order is not None:
            x = x[self.order]
        deepstack = []
        for i, block in enumerate(encoder.blocks):
            x = block(x, self.cos, self.sin, None if i in spec.full_attention_blocks else self.windows)
            if i in spec.deepstack_blocks:
                merger = encoder.deepstack_merger_list[spec.deepstack_blocks.index(i)]
                deepstack.append(merger(x if self.restore is None else x[self.restore]))
        if self.restore is not None:
            x = x[self.restore]
        return torch.stack([encoder.merger(x), *deepstack], dim=1)

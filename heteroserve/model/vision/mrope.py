"""M-RoPE positions of a prompt with images (Qwen2-VL's temporal / height / width scheme).

Text tokens advance one position on all three axes. An image's tokens, laid out row-major over its
merged grid, take temporal = start, height = start + row, width = start + column; the text after it
continues from start + max(rows, columns). Tokens past the prompt (generated ones) sit at their index
plus the prompt's `delta` on all axes, which is how decoding continues without the table.
"""

from __future__ import annotations

import torch


def mrope_positions(
    num_tokens: int, images: list[tuple[int, tuple[int, int, int]]], merge_size: int
) -> tuple[torch.Tensor, int]:
    """images: (placeholder offset, patch grid (t, h, w)) in prompt order; returns ([3, num_tokens], delta)."""
    parts: list[torch.Tensor] = []
    next_pos = 0  # position of the next token
    index = 0  # token index reached
    for offset, (t, h, w) in images:
        if offset > index:
            parts.append(torch.arange(next_pos, next_pos + offset - index).expand(3, -1))
            next_pos += offset - index
        rows, cols = h // merge_size, w // merge_size
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(cols), indexing="ij")
        ).reshape(3, -1)
        parts.append(grid + next_pos)
        next_pos += max(rows, cols)
        index = offset + t * rows * cols
    if num_tokens > index:
        parts.append(torch.arange(next_pos, next_pos + num_tokens - index).expand(3, -1))
        next_pos += num_tokens - index
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return positions, next_pos - num_tokens

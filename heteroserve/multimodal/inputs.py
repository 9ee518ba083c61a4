"""A request's images as the model runner consumes them (the scheduler sees only `ImagePlaceholder`s)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heteroserve.core.request import ImagePlaceholder


@dataclass
class ImageInput:
    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch], the processor's layout
    grid_thw: tuple[int, int, int]  # patches along time, height, width
    placeholder: ImagePlaceholder  # where its tokens sit in the prompt


@dataclass
class MultimodalInputs:
    images: list[ImageInput]
    mrope_positions: torch.Tensor  # [3, num_prompt_tokens]
    mrope_delta: int  # a token at index i >= num_prompt_tokens has position i + delta on every axis

    @property
    def placeholders(self) -> list[ImagePlaceholder]:
        return [image.placeholder for image in self.images]

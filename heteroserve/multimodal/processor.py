"""Prompt + images -> expanded token ids and `MultimodalInputs`, with the checkpoint's own image processor.

transformers' image processor (loaded alone from the checkpoint folder: its PIL variant where torchvision
is missing) resizes each image to the pixel budget, normalises it and cuts it into patches. We expand each
image's single placeholder token into one token per merged patch and compute the M-RoPE positions.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoImageProcessor, PretrainedConfig

from heteroserve.core.request import ImagePlaceholder
from heteroserve.model.vision.mrope import mrope_positions
from heteroserve.multimodal.inputs import ImageInput, MultimodalInputs


class ImageInputProcessor:
    def __init__(
        self,
        folder: Path,
        hf_config: PretrainedConfig,
        max_images: int,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> None:
        budget = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(folder, **budget)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{folder} has no usable image processor config (preprocessor_config.json): {exc}"
            ) from exc
        self.image_token_id = hf_config.image_token_id
        self.merge_size = hf_config.vision_config.spatial_merge_size
        self.max_images = max_images

    def process(self, token_ids: list[int], images: list[Image.Image]) -> tuple[list[int], MultimodalInputs]:
        """Each image's one placeholder token in `token_ids` becomes its run of placeholder tokens."""
        if len(images) > self.max_images:
            raise ValueError(
                f"the prompt has {len(images)} images, more than the limit of {self.max_images} per prompt"
            )
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(
                f"the prompt has {len(slots)} image placeholder tokens (id {self.image_token_id}) for {len(images)} "
                "images; each image needs exactly one (the chat template writes them)"
            )
        if not images:
            raise ValueError("multi_modal_data has no images")
        out = self.image_processor(images=images, return_tensors="pt")
        pixel_values, grids = out["pixel_values"], out["image_grid_thw"].tolist()
        expanded: list[int] = []
        inputs: list[ImageInput] = []
        previous, first_patch = 0, 0
        for slot, grid in zip(slots, grids, strict=True):
            t, h, w = grid
            patches = pixel_values[first_patch : first_patch + t * h * w]
            first_patch += t * h * w
            expanded.extend(token_ids[previous:slot])
            length = t * h * w // self.merge_size**2
            placeholder = ImagePlaceholder(len(expanded), length, _content_hash(patches, grid))
            expanded.extend([self.image_token_id] * length)
            inputs.append(ImageInput(patches, (t, h, w), placeholder))
            previous = slot + 1
        expanded.extend(token_ids[previous:])
        grids_at = [(image.placeholder.offset, image.grid_thw) for image in inputs]
        positions, delta = mrope_positions(len(expanded), grids_at, self.merge_size)
        return expanded, MultimodalInputs(inputs, positions, delta)


def _content_hash(patches: torch.Tensor, grid: list[int]) -> str:
    """Of what the model sees (after resizing), so the same picture under another pixel budget differs."""
    digest = hashlib.sha256(str(grid).encode())
    digest.update(patches.contiguous().numpy().tobytes())
    return digest.hexdigest()

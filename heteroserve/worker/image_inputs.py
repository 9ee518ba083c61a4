"""The image side of a model runner step: M-RoPE positions and image embeddings for the flattened batch.

The vision encoder runs once per image, the first time a prefill chunk reaches the image's tokens; its
embeddings stay with the request until a chunk has consumed the image's last token, so a chunk boundary
may fall anywhere inside an image (each chunk takes its slice of the image's embeddings).
"""

from __future__ import annotations

import torch

from heteroserve.core.scheduler import ScheduledRequest
from heteroserve.model.vision.encoder import VisionEncoder
from heteroserve.multimodal.inputs import MultimodalInputs
from heteroserve.platforms import Platform


class ImageInputs:
    def __init__(self, encoder: VisionEncoder, platform: Platform) -> None:
        self.encoder = encoder
        self.platform = platform
        self.device = platform.device
        # (request id, image index) -> [tokens, 1 + DeepStack layers, hidden], see VisionEncoder.forward
        self._embeddings: dict[tuple[str, int], torch.Tensor] = {}

    def release(self, request_id: str) -> None:
        for key in [k for k in self._embeddings if k[0] == request_id]:
            del self._embeddings[key]

    def prepare(self, items: list[ScheduledRequest]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """[3, T] positions of the flattened batch (items in batch order), and (rows, embeddings) to inject."""
        positions: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        embeddings: list[torch.Tensor] = []
        offset = 0
        for item in items:
            start, n = item.start, item.num_new_tokens
            mm = item.request.multimodal
            if not isinstance(mm, MultimodalInputs):
                positions.append(torch.arange(start, start + n).expand(3, -1))
            else:
                positions.append(_positions(mm, start, n))
                for index, image in enumerate(mm.images):
                    first = max(start, image.placeholder.offset)
                    end = min(start + n, image.placeholder.offset + image.placeholder.length)
                    if first >= end:
                        continue
                    features = self._features(item.request.request_id, index, mm)
                    rows.append(torch.arange(first, end) - start + offset)
                    embeddings.append(features[first - image.placeholder.offset : end - image.placeholder.offset])
                    if end == image.placeholder.offset + image.placeholder.length:
                        del self._embeddings[(item.request.request_id, index)]
            offset += n
        position_tensor = torch.cat(positions, dim=1).to(self.device)
        if not rows:
            return position_tensor, None
        return position_tensor, (torch.cat(rows).to(self.device), torch.cat(embeddings))

    def _features(self, request_id: str, index: int, mm: MultimodalInputs) -> torch.Tensor:
        key = (request_id, index)
        if key not in self._embeddings:
            image = mm.images[index]
            with self.platform.torch_operators():  # the tower is plain torch, not the platform's kernels
                self._embeddings[key] = self.encoder(image.pixel_values, image.grid_thw)
        return self._embeddings[key]


def _positions(mm: MultimodalInputs, start: int, n: int) -> torch.Tensor:
    """Prompt tokens read the M-RoPE table; later (generated) tokens sit at index + delta."""
    prompt_len = mm.mrope_positions.shape[1]
    parts = []
    if start < prompt_len:
        parts.append(mm.mrope_positions[:, start : min(start + n, prompt_len)])
    if start + n > prompt_len:
        parts.append((torch.arange(max(start, prompt_len), start + n) + mm.mrope_delta).expand(3, -1))
    return torch.cat(parts, dim=1)

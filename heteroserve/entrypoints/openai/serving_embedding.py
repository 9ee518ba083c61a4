"""POST /v1/embeddings: OpenAI's shape, one engine request per input."""

from __future__ import annotations

import base64

import numpy as np
import torch
from fastapi.responses import JSONResponse

from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.protocol import EmbeddingRequest, now, random_id
from heteroserve.entrypoints.openai.serving import prompt_inputs, usage
from heteroserve.entrypoints.openai.serving_pooling import PoolingServing


def encode_embedding(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """A list of floats, or base64 of the float32 values in little-endian order (what OpenAI's client decodes)."""
    values = vector.to(torch.float32).numpy()
    if encoding_format == "base64":
        return base64.b64encode(values.astype(np.dtype("<f4"), copy=False).tobytes()).decode("ascii")
    return values.tolist()


class ServingEmbedding(PoolingServing):
    path = "/v1/embeddings"

    async def create(self, request: EmbeddingRequest) -> JSONResponse:
        deadline = self.deadline()
        self.check(request, request.model, self.path, ("embed",))
        if request.input is None:
            raise APIError(400, "input: Field required", "input")
        prompts = prompt_inputs(request.input, "input")
        self.check_count(len(prompts), "input")
        normalize = request.normalize
        if request.use_activation is not None:
            if normalize is not None and normalize != request.use_activation:
                raise APIError(400, "normalize and use_activation disagree (they are one setting)", "use_activation")
            normalize = request.use_activation
        params = self.pooling_params(
            task="embed",
            dimensions=request.dimensions,
            normalize=normalize,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
        place = self.check_capacity()
        request_id = random_id("embd")
        single = isinstance(request.input, str) or isinstance(request.input[0], int)
        outputs = await self.pool(
            request_id,
            [(prompt, params) for prompt in prompts],
            request.priority,
            place,
            deadline,
            lambda i: "input" if single else f"input[{i}]",
        )
        data = [
            {"index": i, "object": "embedding", "embedding": encode_embedding(o.outputs.data, request.encoding_format)}
            for i, o in enumerate(outputs)
        ]
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        body = {
            "id": request_id,
            "object": "list",
            "created": now(),
            "model": self.model_name,
            "data": data,
            "usage": usage(tokens, 0),
        }
        return JSONResponse(body)

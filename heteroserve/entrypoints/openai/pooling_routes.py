"""The pooling models' routes: /v1/embeddings, /rerank and /v1/rerank, /score and /v1/score."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request

from heteroserve.engine.async_engine import AsyncLLMEngine
from heteroserve.entrypoints.openai.gate import unless_disconnected
from heteroserve.entrypoints.openai.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from heteroserve.entrypoints.openai.serving import Admission, ServerSettings
from heteroserve.entrypoints.openai.serving_embedding import ServingEmbedding
from heteroserve.entrypoints.openai.serving_score import ServingScores
from heteroserve.metrics.prometheus import ServerMetrics

logger = logging.getLogger("heteroserve.server")


def add_pooling_routes(
    app: FastAPI,
    engine: AsyncLLMEngine,
    settings: ServerSettings,
    metrics: ServerMetrics,
    admission: Admission,
    responses: dict,
    log_requests: bool = False,
) -> None:
    """Registers the routes on `app`. On a text generation model they answer 400 naming its task, as the
    generation routes do on a pooling model."""
    embeddings = ServingEmbedding(engine, settings, metrics, admission)
    scores = ServingScores(engine, settings, metrics, admission)

    @app.post("/v1/embeddings", responses=responses)
    async def create_embedding(body: EmbeddingRequest, request: Request):
        if log_requests:
            logger.info("embedding request: %s", body.model_dump_json())
        return await unless_disconnected(request, embeddings.create(body), embeddings.client_left)

    async def rerank(body: RerankRequest, request: Request):
        if log_requests:
            logger.info("rerank request: %s", body.model_dump_json())
        return await unless_disconnected(request, scores.rerank(body, request.url.path), scores.client_left)

    async def score(body: ScoreRequest, request: Request):
        if log_requests:
            logger.info("score request: %s", body.model_dump_json())
        return await unless_disconnected(request, scores.score(body, request.url.path), scores.client_left)

    for path in ("/rerank", "/v1/rerank"):
        app.add_api_route(path, rerank, methods=["POST"], responses=responses, name="rerank")
    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score, methods=["POST"], responses=responses, name="score")

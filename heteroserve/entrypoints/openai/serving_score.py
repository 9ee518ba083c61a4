"""POST /rerank and /v1/rerank (Jina's and Cohere's shape, as vLLM serves it), /score and /v1/score (vLLM's).

A cross-encoder (task score) reads each (query, document) pair as one input and its score is the model's output; an
embedding model (task embed) embeds each text once and a pair's score is the cosine similarity of the two
embeddings, as vLLM does."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable

import torch
from fastapi.responses import JSONResponse

from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.protocol import RerankRequest, ScoreRequest, now, random_id
from heteroserve.entrypoints.openai.serving import WaitingPlace, usage
from heteroserve.entrypoints.openai.serving_pooling import PoolingServing
from heteroserve.outputs import PoolingRequestOutput

SCORING_TASKS = ("embed", "score")
# PoolingServing.pool with one request's id, priority, waiting place and deadline bound: (inputs, locate=...).
Pool = Callable[..., Awaitable[list[PoolingRequestOutput]]]


class Side:
    """One side of the pairs to score: the body field it came from, and its texts (a string is one text)."""

    def __init__(self, name: str, given: str | list[str]) -> None:
        self.name, self.single = name, isinstance(given, str)
        self.texts = [given] if self.single else given

    def where(self, i: int) -> str:
        return self.name if self.single else f"{self.name}[{i}]"


def score_sides(request: ScoreRequest) -> tuple[Side, Side]:
    """The two sides of a /score body, under whichever pair of names vLLM accepts; 1:1, 1:N or N:N."""
    given = {name for pair in request.pair_names for name in pair if getattr(request, name) is not None}
    for first, second in request.pair_names:
        if given == {first, second}:
            one, two = Side(first, getattr(request, first)), Side(second, getattr(request, second))
            if len(one.texts) not in (1, len(two.texts)):
                message = f"{first} has {len(one.texts)} texts and {second} {len(two.texts)}: score 1:1, 1:N or N:N"
                raise APIError(400, message, first)
            return one, two
    names = ", ".join(f"{a} and {b}" for a, b in request.pair_names[1:])
    shown = f" (this body has {', '.join(sorted(given))})" if given else ""
    raise APIError(400, f"give text_1 and text_2 (or {names}){shown}", "text_1")


class ServingScores(PoolingServing):
    async def rerank(self, request: RerankRequest, path: str) -> JSONResponse:
        deadline = self.deadline()
        self.check(request, request.model, path, SCORING_TASKS)
        documents = Side("documents", request.documents)
        self.check_count(len(documents.texts), documents.name)
        place = self.check_capacity()
        request_id = random_id("rerank")
        query = Side("query", request.query)
        scores, tokens = await self._scores(request_id, query, documents, request, place, deadline)
        results = [
            {
                "index": i,
                **({"document": {"text": text}} if request.return_documents else {}),
                "relevance_score": score,
            }
            for i, (text, score) in enumerate(zip(documents.texts, scores, strict=True))
        ]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)  # stable: equal scores keep their order
        if request.top_n > 0:
            results = results[: request.top_n]
        body = {
            "id": request_id,
            "model": self.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }
        return JSONResponse(body)

    async def score(self, request: ScoreRequest, path: str) -> JSONResponse:
        deadline = self.deadline()
        self.check(request, request.model, path, SCORING_TASKS)
        first, second = score_sides(request)
        self.check_count(len(second.texts), second.name)
        place = self.check_capacity()
        request_id = random_id("score")
        scores, tokens = await self._scores(request_id, first, second, request, place, deadline)
        body = {
            "id": request_id,
            "object": "list",
            "created": now(),
            "model": self.model_name,
            "data": [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)],
            "usage": usage(tokens, 0),
        }
        return JSONResponse(body)

    async def _scores(
        self,
        request_id: str,
        first: Side,
        second: Side,
        request: RerankRequest | ScoreRequest,
        place: WaitingPlace | None,
        deadline: float | None,
    ) -> tuple[list[float], int]:
        """Each pair's score (pair i: `second`'s text i with `first`'s only text, or its text i), and the prompt
        tokens the engine read."""
        start = functools.partial(self.pool, request_id, priority=request.priority, place=place, deadline=deadline)
        if self.task == "score":
            return await self._cross_encoded(start, first, second, request.truncate_prompt_tokens)
        return await self._cosines(start, first, second, request.truncate_prompt_tokens)

    async def _cross_encoded(
        self, start: Pool, first: Side, second: Side, truncate_prompt_tokens: int | None
    ) -> tuple[list[float], int]:
        params = self.pooling_params(task="score")
        pairs = [(first.texts[0 if len(first.texts) == 1 else i], text) for i, text in enumerate(second.texts)]
        # Tokenizing many documents takes a while: off the event loop, as completions do.
        prompts = await asyncio.to_thread(self._tokenize_pairs, pairs, truncate_prompt_tokens)
        outputs = await start([(prompt, params) for prompt in prompts], locate=second.where)
        return [float(o.outputs.data[0]) for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)

    def _tokenize_pairs(self, pairs: list[tuple[str, str]], truncate_prompt_tokens: int | None) -> list[dict]:
        """Runs in a worker thread (the engine truncates on a private tokenizer copy, so threads may share it)."""
        try:
            return [self.engine.processor.tokenize_pair(a, b, truncate_prompt_tokens) for a, b in pairs]
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    async def _cosines(
        self, start: Pool, first: Side, second: Side, truncate_prompt_tokens: int | None
    ) -> tuple[list[float], int]:
        params = self.pooling_params(task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
        count = len(first.texts)
        outputs = await start(
            [(text, params) for text in first.texts + second.texts],
            locate=lambda i: first.where(i) if i < count else second.where(i - count),
        )
        ones, twos = outputs[:count], outputs[count:]
        scores = [
            torch.nn.functional.cosine_similarity(
                ones[0 if count == 1 else i].outputs.data, two.outputs.data, dim=0
            ).item()
            for i, two in enumerate(twos)
        ]
        return scores, sum(len(o.prompt_token_ids) for o in outputs)

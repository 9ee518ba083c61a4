"""What /v1/embeddings, /rerank and /score share: which routes the model's task allows, one engine request per
input, started together so they batch, and the pooling metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from heteroserve.engine.llm_engine import PromptInput
from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.protocol import RequestBody
from heteroserve.entrypoints.openai.serving import OpenAIServing, WaitingPlace, check_fields
from heteroserve.outputs import PoolingRequestOutput
from heteroserve.pooling_params import PoolingParams

MAX_INPUTS = 2048  # inputs (or pairs) in one request: OpenAI's limit for embeddings

_KINDS = {
    "generate": "a text generation model",
    "embed": "an embedding model",
    "score": "a cross-encoder",
}
_ROUTES = {
    "generate": "/v1/completions or /v1/chat/completions",
    "embed": "/v1/embeddings, /v1/rerank or /score",
    "score": "/v1/rerank or /score",
}


def require_task(serving: OpenAIServing, model: str | None, path: str, tasks: Sequence[str]) -> None:
    """The requested model must be this server's (404) and its task one that `path` serves (400 naming the task)."""
    serving.check_model(model)
    task = serving.engine.model.task
    if task not in tasks:
        name = serving.model_name
        raise APIError(400, f"model {name!r} is {_KINDS[task]} (task {task}): use {_ROUTES[task]}, not {path}", "model")


class PoolingServing(OpenAIServing):
    @property
    def task(self) -> str:
        return self.engine.model.task

    def check(self, body: RequestBody, model: str | None, path: str, tasks: Sequence[str]) -> None:
        require_task(self, model, path, tasks)
        check_fields(body)

    def check_count(self, count: int, field: str) -> None:
        if count > MAX_INPUTS:
            raise APIError(400, f"{field} holds {count} inputs; one request takes at most {MAX_INPUTS}", field)

    def pooling_params(self, **fields) -> PoolingParams:
        """PoolingParams the model accepts; what it cannot do (dimensions without Matryoshka) is a 400, naming the
        field its message starts with, before any engine request starts."""
        try:
            params = PoolingParams(**fields)
            self.engine.model.pooler_spec.check(params)
        except ValueError as exc:
            param = next((name for name in fields if str(exc).startswith(name)), None)
            raise APIError(400, str(exc), param) from exc
        return params

    def _tokenized(
        self, inputs: Sequence[tuple[PromptInput, PoolingParams]], locate: Callable[[int], str]
    ) -> list[PromptInput]:
        engine = self.engine.engine
        prompts = []
        for i, (prompt, params) in enumerate(inputs):
            try:
                prompts.append(engine.processor.pooling_prompt(prompt, params))
            except ValueError as exc:
                where = locate(i)
                raise APIError(400, f"{where}: {exc}", where.partition("[")[0]) from exc
        return prompts

    async def pool(
        self,
        request_id: str,
        inputs: Sequence[tuple[PromptInput, PoolingParams]],
        priority: int,
        place: WaitingPlace | None,
        deadline: float | None,
        locate: Callable[[int], str],
    ) -> list[PoolingRequestOutput]:
        """Each input's output, in order. All enter the engine before any is awaited, so they share steps. A refused
        input is a 400 naming its place in the body (`locate(i)`, e.g. "input[3]"); the others' results are dropped."""
        # Tokenizing a few thousand texts takes a while: in a thread, not in the engine's (which would stall
        # every request's steps) nor on the event loop.
        prompts = await asyncio.to_thread(self._tokenized, inputs, locate)
        results = await asyncio.gather(
            *(
                self.start(f"{request_id}-{i}", prompt, params, priority, place, deadline)
                for i, (prompt, (_, params)) in enumerate(zip(prompts, inputs, strict=True))
            ),
            return_exceptions=True,
        )
        for result in results:  # a pooling request has one output: its stream is over, or aborted here
            if not isinstance(result, BaseException):
                await result[1].aclose()
        for i, result in enumerate(results):
            if isinstance(result, APIError) and result.status == 400:
                where = locate(i)
                raise APIError(400, f"{where}: {result.message}", result.param or where.partition("[")[0])
            if isinstance(result, BaseException):
                raise result
        outputs = [first for first, _ in results]
        for output, (_, params) in zip(outputs, inputs, strict=True):
            self.metrics.observe_pooling(params.task, output.metrics, len(output.prompt_token_ids))
        return outputs

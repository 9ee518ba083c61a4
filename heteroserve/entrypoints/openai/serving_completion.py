"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from heteroserve.engine.llm_engine import PromptInput
from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.protocol import CompletionRequest, now, random_id
from heteroserve.entrypoints.openai.serving import OpenAIServing, merge, sse, usage
from heteroserve.outputs import CompletionOutput, RequestOutput


def _prompts(prompt: str | list) -> list[PromptInput]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": prompt}]
    if all(isinstance(p, list) for p in prompt):
        if any(not p for p in prompt):
            raise APIError(400, "prompt token lists must not be empty", "prompt")
        return [{"prompt_token_ids": p} for p in prompt]
    return list(prompt)


def completion_logprobs(output: CompletionOutput, text_offset: int, top: int, as_ids: bool = False) -> dict | None:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    if output.logprobs is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    name = (lambda t, lp: f"token_id:{t}") if as_ids else (lambda t, lp: lp.decoded_token or "")
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=False):
        chosen = entry[token_id]
        text = chosen.decoded_token or ""
        tokens.append(name(token_id, chosen))
        values.append(chosen.logprob)
        tops.append({name(t, lp): lp.logprob for t, lp in entry.items() if lp.rank <= top})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class ServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest) -> JSONResponse | StreamingResponse:
        self.check_model(request.model)
        self.check_capacity()
        prompts = _prompts(request.prompt)
        request_id = random_id("cmpl")
        prepared = []
        for prompt in prompts:
            text, ids = self._tokenize(prompt)
            max_tokens = self.max_tokens_for(len(ids), request.max_tokens)
            params = self.params(lambda m=max_tokens: request.sampling_params(m, self.defaults, request.logprobs))
            prepared.append(({"prompt": text, "prompt_token_ids": ids}, params))
        # All prompts enter the engine before any first token is awaited, so their prefills share steps.
        results = await asyncio.gather(
            *(self.start(f"{request_id}-{i}", p, params, request.priority) for i, (p, params) in enumerate(prepared)),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for result in results:
                if not isinstance(result, BaseException):
                    await result[1].aclose()
            raise failures[0]
        started = results
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, started), media_type="text/event-stream")
        return JSONResponse(await self._full(request, request_id, started))

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        try:
            return self.engine.engine.tokenize_prompt(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from exc

    async def _full(self, request: CompletionRequest, request_id: str, started) -> dict:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, (first, stream) in enumerate(started):
            final = None
            async for output in self.rest(first, stream):
                final = output
            prompt_tokens += len(final.prompt_token_ids)
            prefix = final.prompt or "" if request.echo else ""
            for completion in final.outputs:
                completion_tokens += len(completion.token_ids)
                self.record(final, len(completion.token_ids), completion.finish_reason)
                choices.append(
                    {
                        "index": i * request.n + completion.index,
                        "text": prefix + completion.text,
                        "logprobs": completion_logprobs(
                            completion, len(prefix), request.logprobs or 0, request.return_tokens_as_token_ids
                        ),
                        "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason,
                    }
                )
        choices.sort(key=lambda c: c["index"])
        totals = usage(prompt_tokens, completion_tokens)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": totals,
        }

    async def _stream(self, request: CompletionRequest, request_id: str, started) -> AsyncIterator[str]:
        created = now()
        counts: dict[int, int] = {}
        offsets: dict[int, int] = {}
        prompt_tokens = 0

        async def tagged(i: int, first: RequestOutput, stream) -> AsyncIterator[tuple[int, RequestOutput]]:
            async for output in self.rest(first, stream):
                yield i, output

        chunk = functools.partial(self.stream_chunk, request_id, "text_completion", created)

        try:
            echoed: set[int] = set()
            async for i, output in merge([tagged(i, f, s) for i, (f, s) in enumerate(started)]):
                if i not in echoed:
                    echoed.add(i)
                    prompt_tokens += len(output.prompt_token_ids)
                    if request.echo:
                        for k in range(request.n):
                            offsets[i * request.n + k] = len(output.prompt or "")
                            yield chunk(
                                [
                                    {
                                        "index": i * request.n + k,
                                        "text": output.prompt or "",
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                ]
                            )
                for completion in output.outputs:
                    index = i * request.n + completion.index
                    counts[index] = counts.get(index, 0) + len(completion.token_ids)
                    logprobs = completion_logprobs(
                        completion, offsets.get(index, 0), request.logprobs or 0, request.return_tokens_as_token_ids
                    )
                    offsets[index] = offsets.get(index, 0) + len(completion.text)
                    if completion.finish_reason is not None:
                        self.record(output, counts[index], completion.finish_reason)
                    if completion.text or completion.token_ids or completion.finish_reason:
                        yield chunk(
                            [
                                {
                                    "index": index,
                                    "text": completion.text,
                                    "logprobs": logprobs,
                                    "finish_reason": completion.finish_reason,
                                    "stop_reason": completion.stop_reason,
                                }
                            ]
                        )
            if request.stream_options and request.stream_options.include_usage:
                generated = sum(counts.values())
                yield chunk([], usage(prompt_tokens, generated))
        except APIError as exc:
            yield sse(exc.body())
        yield sse("[DONE]")

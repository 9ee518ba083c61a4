"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from heteroserve.engine.llm_engine import PromptInput
from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.protocol import CompletionRequest, now, random_id
from heteroserve.entrypoints.openai.serving import (
    OpenAIServing,
    merge,
    prompt_inputs,
    prompt_logprobs_field,
    sse,
    usage,
)
from heteroserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from heteroserve.sampling_params import SamplingParams


def joined(first: dict | None, second: dict | None) -> dict | None:
    """Two logprobs objects one after the other (the echoed prompt's, then the completion's)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


class ServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest) -> JSONResponse | StreamingResponse:
        deadline = self.deadline()
        lora = self.check_model(request.model)
        self.check_request(request)
        if request.max_tokens == 0 and not request.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo=true, to score the prompt)", "max_tokens")
        place = self.check_capacity()
        prompts = prompt_inputs(request.prompt, "prompt")
        limit = self.settings.max_prompts_per_request
        if len(prompts) > limit:
            raise APIError(
                400,
                f"prompt holds {len(prompts)} prompts; this server takes at most {limit} in one request "
                "(--max-prompts-per-request)",
                "prompt",
            )
        request_id = random_id("cmpl")
        # Tokenizing a long prompt takes seconds: off the event loop (the tokenizer releases the GIL meanwhile).
        prepared = await asyncio.to_thread(self._prepare, request, prompts)
        # All prompts enter the engine before any first token is awaited, so their prefills share steps.
        results = await asyncio.gather(
            *(
                self.start(f"{request_id}-{i}", p, params, request.priority, place, deadline, lora)
                for i, (p, params) in enumerate(prepared)
            ),
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
            return StreamingResponse(
                self._stream(request, request_id, started, deadline), media_type="text/event-stream"
            )
        return JSONResponse(await self._full(request, request_id, started, deadline))

    def _prepare(self, request: CompletionRequest, prompts: list[PromptInput]) -> list[tuple[dict, SamplingParams]]:
        """Each prompt's engine input (text and token ids) and sampling parameters."""
        # Echo with logprobs scores the prompt too: the engine computes its logprobs (as many as either asks for).
        asked = [request.prompt_logprobs, request.logprobs if request.echo else None]
        prompt_logprobs = max((k for k in asked if k is not None), default=None)
        prepared = []
        for prompt in prompts:
            text, ids = self._tokenize(prompt)
            if request.echo and text is None and self.tokenizer is not None:
                text = self.tokenizer.decode(ids)  # a token-id prompt is echoed as text
            # max_tokens 0 (echo only) still samples one token, which the answer leaves out, as vLLM does.
            max_tokens = self.max_tokens_for(len(ids), 1 if request.max_tokens == 0 else request.max_tokens)
            params = self.params(
                lambda m=max_tokens: request.sampling_params(m, self.defaults, request.logprobs, prompt_logprobs)
            )
            prepared.append(({"prompt": text, "prompt_token_ids": ids}, params))
        return prepared

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        try:
            return self.engine.processor.tokenize_prompt(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from exc

    def _logprobs(
        self, request: CompletionRequest, token_ids: list[int], entries: SampleLogprobs | PromptLogprobs, offset: int
    ) -> dict:
        """The legacy completions logprobs object (tokens, token_logprobs, top_logprobs, text_offset) of these
        tokens, starting at character `offset` of the choice's text. top_logprobs holds the `logprobs` most likely
        tokens and the token itself (OpenAI's up to logprobs + 1); an entry of None (a prompt's first token, which
        has no context) gives null for both."""
        top, as_ids = request.logprobs or 0, request.return_tokens_as_token_ids
        tokens, values, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=True):
            chosen = entry[token_id] if entry is not None else None
            text = self._decoded(token_id, chosen)
            tokens.append(f"token_id:{token_id}" if as_ids else text)
            values.append(chosen.logprob if chosen is not None else None)
            if entry is None:
                tops.append(None)
            else:
                ranked = [(t, lp) for t, lp in entry.items() if lp.rank <= top or t == token_id]
                tops.append({f"token_id:{t}" if as_ids else self._decoded(t, lp): lp.logprob for t, lp in ranked})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _decoded(self, token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def _echo(self, request: CompletionRequest, output: RequestOutput) -> tuple[str, dict | None]:
        """What a choice starts with under echo: the prompt's text and, with logprobs, the prompt's logprobs."""
        if not request.echo:
            return "", None
        text = output.prompt or ""
        if request.logprobs is None:
            return text, None
        return text, self._logprobs(request, output.prompt_token_ids, output.prompt_logprobs, 0)

    def _choice(
        self, request: CompletionRequest, index: int, output: RequestOutput, completion: CompletionOutput
    ) -> dict:
        """One choice of a JSON answer: the echo, then the completion (none when max_tokens is 0)."""
        text, logprobs = self._echo(request, output)
        finish_reason, stop_reason = "length", None
        if request.max_tokens != 0:
            if completion.logprobs is not None:
                logprobs = joined(
                    logprobs, self._logprobs(request, completion.token_ids, completion.logprobs, len(text))
                )
            text += completion.text
            finish_reason, stop_reason = completion.finish_reason, completion.stop_reason
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            **prompt_logprobs_field(request.prompt_logprobs, output),
        }

    async def _full(self, request: CompletionRequest, request_id: str, started, deadline: float | None) -> dict:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        try:
            for i, (first, stream) in enumerate(started):
                final = None
                async for output in self.rest(first, stream, deadline):
                    final = output
                prompt_tokens += len(final.prompt_token_ids)
                for completion in final.outputs:
                    self.record(final, len(completion.token_ids), completion.finish_reason)
                    if request.max_tokens != 0:
                        completion_tokens += len(completion.token_ids)
                    choices.append(self._choice(request, i * request.n + completion.index, final, completion))
        finally:  # past the deadline, the prompts not yet read are aborted too
            for _, stream in started:
                await stream.aclose()
        choices.sort(key=lambda c: c["index"])
        totals = usage(prompt_tokens, completion_tokens)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": self.response_model(request.model),
            "choices": choices,
            "usage": totals,
        }

    async def _stream(
        self, request: CompletionRequest, request_id: str, started, deadline: float | None
    ) -> AsyncIterator[str]:
        created = now()
        counts: dict[int, int] = {}
        offsets: dict[int, int] = {}
        prompt_tokens = 0

        async def tagged(i: int, first: RequestOutput, stream) -> AsyncIterator[tuple[int, RequestOutput]]:
            async for output in self.rest(first, stream, deadline):
                yield i, output

        chunk = functools.partial(
            self.stream_chunk, request_id, "text_completion", self.response_model(request.model), created
        )

        echo_only = request.max_tokens == 0
        answered = False  # every choice has finished
        try:
            echoed: set[int] = set()
            async for i, output in merge([tagged(i, f, s) for i, (f, s) in enumerate(started)]):
                if i not in echoed:
                    echoed.add(i)
                    prompt_tokens += len(output.prompt_token_ids)
                    if request.echo:
                        text, logprobs = self._echo(request, output)
                        for k in range(request.n):
                            offsets[i * request.n + k] = len(text)
                            choice = {"index": i * request.n + k, "text": text, "logprobs": logprobs}
                            yield chunk([{**choice, "finish_reason": "length" if echo_only else None}])
                for completion in output.outputs:
                    index = i * request.n + completion.index
                    counts[index] = counts.get(index, 0) + len(completion.token_ids)
                    if completion.finish_reason is not None:
                        self.record(output, counts[index], completion.finish_reason)
                    if echo_only or not (completion.text or completion.token_ids or completion.finish_reason):
                        continue
                    logprobs = None
                    if completion.logprobs is not None:
                        logprobs = self._logprobs(
                            request, completion.token_ids, completion.logprobs, offsets.get(index, 0)
                        )
                    offsets[index] = offsets.get(index, 0) + len(completion.text)
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
            answered = True
            if request.stream_options and request.stream_options.include_usage:
                generated = 0 if echo_only else sum(counts.values())
                yield chunk([], usage(prompt_tokens, generated))
        except APIError as exc:
            yield sse(exc.body())
        except (asyncio.CancelledError, GeneratorExit):  # the client left (Starlette cancels or closes the stream)
            if not answered:
                self.client_left()
            raise
        yield sse("[DONE]")

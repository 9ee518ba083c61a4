"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image

from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.protocol import ChatCompletionRequest, now, random_id
from heteroserve.entrypoints.openai.serving import OpenAIServing, sse, usage
from heteroserve.multimodal.chat import split_images
from heteroserve.multimodal.media import ImageError
from heteroserve.outputs import CompletionOutput


def chat_logprobs(output: CompletionOutput, top: int) -> dict | None:
    if output.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=False):
        chosen = entry[token_id]
        ranked = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)
        content.append(
            {
                "token": chosen.decoded_token or "",
                "logprob": chosen.logprob,
                "bytes": list((chosen.decoded_token or "").encode()),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token or "",
                        "logprob": lp.logprob,
                        "bytes": list((lp.decoded_token or "").encode()),
                    }
                    for lp in ranked
                ],
            }
        )
    return {"content": content}


class ServingChat(OpenAIServing):
    def render(self, request: ChatCompletionRequest) -> tuple[str, list[int], list[Image.Image]]:
        """The prompt text, its token ids, and the images in the order their placeholders appear.

        Runs in a worker thread: decoding (or fetching) images must not stall the event loop."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it has no chat template")
        messages: list[dict] = [{"role": m.role, "content": m.text()} for m in request.messages]
        images: list[Image.Image] = []
        if any(m.has_images for m in request.messages):
            if self.engine.engine.image_processor is None:
                raise APIError(400, f"{self.model_name} is a text-only model: it does not accept images", "messages")
            raw = [m.model_dump(exclude_none=True) for m in request.messages]
            try:
                messages, images = split_images(raw, self.settings.media)
            except ImageError as exc:
                raise APIError(400, str(exc), "messages") from exc
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                chat_template=request.chat_template or self.settings.chat_template,
            )
        except Exception as exc:  # jinja2 errors from the template (e.g. roles it rejects)
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from exc
        return text, self.tokenizer.encode(text, add_special_tokens=False), images

    async def create(self, request: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        self.check_model(request.model)
        self.check_capacity()
        text, ids, images = await asyncio.to_thread(self.render, request)
        max_tokens = self.max_tokens_for(len(ids), request.max_completion_tokens or request.max_tokens)
        top = request.top_logprobs or 0
        logprobs = top if request.logprobs else None
        params = self.params(lambda: request.sampling_params(max_tokens, self.defaults, logprobs))
        request_id = random_id("chatcmpl")
        prompt = {"prompt": text, "prompt_token_ids": ids}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        first, stream = await self.start(request_id, prompt, params, request.priority)
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, first, stream, top), media_type="text/event-stream"
            )
        final = None
        async for output in self.rest(first, stream):
            final = output
        choices, completion_tokens = [], 0
        for completion in final.outputs:
            completion_tokens += len(completion.token_ids)
            self.record(final, len(completion.token_ids), completion.finish_reason)
            choices.append(
                {
                    "index": completion.index,
                    "message": {"role": "assistant", "content": completion.text},
                    "logprobs": chat_logprobs(completion, top),
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
            )
        totals = usage(len(final.prompt_token_ids), completion_tokens)  # images expanded
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": now(),
                "model": self.model_name,
                "choices": choices,
                "usage": totals,
            }
        )

    async def _stream(self, request, request_id, first, stream, top) -> AsyncIterator[str]:
        created = now()
        counts: dict[int, int] = {}

        chunk = functools.partial(self.stream_chunk, request_id, "chat.completion.chunk", created)

        try:
            for index in range(request.n):
                yield chunk(
                    [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            prompt_tokens = len(first.prompt_token_ids)
            async for output in self.rest(first, stream):
                for completion in output.outputs:
                    counts[completion.index] = counts.get(completion.index, 0) + len(completion.token_ids)
                    if completion.finish_reason is not None:
                        self.record(output, counts[completion.index], completion.finish_reason)
                    if not (completion.text or completion.token_ids or completion.finish_reason):
                        continue
                    delta = {"content": completion.text} if completion.text else {}
                    yield chunk(
                        [
                            {
                                "index": completion.index,
                                "delta": delta,
                                "logprobs": chat_logprobs(completion, top),
                                "finish_reason": completion.finish_reason,
                            }
                        ]
                    )
            if request.stream_options and request.stream_options.include_usage:
                generated = sum(counts.values())
                yield chunk([], usage(prompt_tokens, generated))
        except APIError as exc:
            yield sse(exc.body())
        yield sse("[DONE]")

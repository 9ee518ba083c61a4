"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image
from transformers import PreTrainedTokenizerBase

from heteroserve.engine.async_engine import AsyncLLMEngine
from heteroserve.entrypoints.openai.chat_output import (
    AutoCallsOutput,
    ChoiceDeltas,
    NamedCallOutput,
    PlainOutput,
    RequiredCallsOutput,
    ToolOutput,
    merge_deltas,
)
from heteroserve.entrypoints.openai.chat_template import (
    ChatTemplateRenderer,
    TemplateTimeout,
    TemplateTooLarge,
    max_prompt_chars,
)
from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, now, random_id
from heteroserve.entrypoints.openai.serving import (
    Admission,
    OpenAIServing,
    ServerSettings,
    prompt_logprobs_field,
    sse,
    usage,
)
from heteroserve.entrypoints.openai.template_workers import TemplateWorkers
from heteroserve.entrypoints.openai.tool_parsers import tool_parser
from heteroserve.entrypoints.openai.tools import forced_calls_params, named_function, template_tool_calls
from heteroserve.metrics.prometheus import ServerMetrics
from heteroserve.multimodal.chat import split_images
from heteroserve.multimodal.media import ImageError
from heteroserve.outputs import CompletionOutput
from heteroserve.structured_output import StructuredOutputsParams


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


# apply_chat_template's own arguments and the conversation: request fields set these, chat_template_kwargs may not.
_TEMPLATE_ARGUMENTS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self",
    "kwargs",
} | {"messages"}


def template_options(request: ChatCompletionRequest) -> dict:
    """add_generation_prompt, continue_final_message (vLLM's: the last message stays open for the model to go on;
    it turns the generation prompt off unless that is asked for too, which is a 400) and chat_template_kwargs."""
    generation_prompt = request.add_generation_prompt
    if request.continue_final_message:
        if generation_prompt and "add_generation_prompt" in request.model_fields_set:
            raise APIError(
                400, "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
            )
        generation_prompt = False
    extra = request.chat_template_kwargs or {}
    clashing = sorted(_TEMPLATE_ARGUMENTS & set(extra))
    if clashing:
        raise APIError(
            400,
            f"chat_template_kwargs cannot set {', '.join(clashing)}: the request's fields do",
            "chat_template_kwargs",
        )
    return {
        "add_generation_prompt": generation_prompt,
        "continue_final_message": request.continue_final_message,
        "variables": extra,
    }


# Compiling a template cannot be interrupted (~1 s for 64 KiB of dense Jinja); models' own templates are < 20 KB.
MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024
# Request templates render in this many worker processes, each waited on by a thread of its own.
REQUEST_TEMPLATE_WORKERS = 2


class ServingChat(OpenAIServing):
    def __init__(
        self, engine: AsyncLLMEngine, settings: ServerSettings, metrics: ServerMetrics, admission: Admission
    ) -> None:
        super().__init__(engine, settings, metrics, admission)
        self.templates = None
        if self.tokenizer is not None:
            self.templates = ChatTemplateRenderer(self.tokenizer, max_prompt_chars(self.tokenizer, self.max_model_len))
        # Requests' own templates render in worker processes (a memory cap, killed at the deadline), waited on in
        # threads of their own, so that slow ones never hold up the others.
        self.request_template_threads = self.request_template_workers = None
        if self.settings.trust_request_chat_template and self.templates is not None:
            self.request_template_threads = ThreadPoolExecutor(
                max_workers=REQUEST_TEMPLATE_WORKERS, thread_name_prefix="request-templates"
            )
            self.request_template_workers = TemplateWorkers(REQUEST_TEMPLATE_WORKERS, self.templates.max_chars)

    async def render_in_thread(
        self, request: ChatCompletionRequest, deadline: float | None = None
    ) -> tuple[str, list[int], list[Image.Image]]:
        """`render` in a worker thread: templates, images and tokenizing must not stall the event loop.
        --chat-template-timeout counts from now, waiting for a thread included."""
        self._check_request_template(request.chat_template)
        threads = self.request_template_threads if request.chat_template is not None else None
        template_deadline = time.monotonic() + self.settings.chat_template_timeout
        return await asyncio.get_running_loop().run_in_executor(
            threads, self.render, request, deadline, template_deadline
        )

    def render(
        self, request: ChatCompletionRequest, deadline: float | None, template_deadline: float
    ) -> tuple[str, list[int], list[Image.Image]]:
        """The prompt text, its token ids, and the images in the order their placeholders appear. The template
        renders by `template_deadline`, or by the request's `deadline` when that comes first (a 408 then)."""
        if self.templates is None:
            raise APIError(400, "this model has no tokenizer, so it has no chat template")
        messages = [self._template_message(m) for m in request.messages]
        images: list[Image.Image] = []
        if any(m.has_images for m in request.messages):
            if self.engine.processor.image_processor is None:
                raise APIError(400, f"{self.model_name} is a text-only model: it does not accept images", "messages")
            raw = [m.model_dump(exclude_none=True) for m in request.messages]
            try:
                with_images, images = split_images(raw, self.settings.media)
            except ImageError as exc:
                raise APIError(400, str(exc), "messages") from exc
            for message, content in zip(messages, with_images, strict=True):
                message["content"] = content["content"]
        # tool_choice "none": the model is not shown the tools, so it has no format in which to call them.
        tools = None
        if request.tools and request.tool_choice != "none":
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
        if self.settings.tool_call_parser is not None:  # the model's format for calls is its history's too
            try:
                messages = tool_parser(self.settings.tool_call_parser).template_messages(messages, tools)
            except ValueError as exc:
                raise APIError(400, str(exc), "messages") from exc
        options = template_options(request)
        by_request = deadline is not None and deadline < template_deadline
        # What a rendering too slow or too large is blamed on: the request's template, or its messages.
        param = "chat_template" if request.chat_template is not None else "messages"
        subject = "chat_template" if request.chat_template is not None else "the chat template, applied to messages,"
        renderer = self.request_template_workers if request.chat_template is not None else self.templates
        try:
            job = self.templates.job(
                messages, chat_template=request.chat_template or self.settings.chat_template, tools=tools, **options
            )
            text = renderer.render(job, (deadline if by_request else template_deadline) - time.monotonic())
        except TemplateTimeout as exc:
            if by_request:
                raise self.timed_out() from exc
            timeout = self.settings.chat_template_timeout
            raise APIError(
                400, f"{subject} did not finish rendering within {timeout} s (--chat-template-timeout)", param
            ) from exc
        except TemplateTooLarge as exc:
            raise APIError(
                400,
                f"{subject} was stopped: it built {exc} (a prompt of max_model_len = {self.max_model_len} tokens "
                f"holds at most {self.templates.max_chars} characters)",
                param,
            ) from exc
        except Exception as exc:  # jinja2 errors from the template (e.g. roles it rejects)
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from exc
        return text, self.tokenizer.encode(text, add_special_tokens=False), images

    def _check_request_template(self, template: str | None) -> None:
        """A request's chat template is code the server runs: refused unless the operator trusts clients with it."""
        if template is None:
            return
        if not self.settings.trust_request_chat_template:
            raise APIError(
                400,
                "chat_template in a request is refused: templates are code the server runs; start the server "
                "with --trust-request-chat-template to accept them (or --chat-template to set one for all requests)",
                "chat_template",
            )
        if len(template) > MAX_REQUEST_TEMPLATE_CHARS:
            raise APIError(
                400,
                f"chat_template is {len(template)} characters; a request's template may have at most "
                f"{MAX_REQUEST_TEMPLATE_CHARS}",
                "chat_template",
            )

    @staticmethod
    def _template_message(message: ChatMessage) -> dict:
        """A history message as chat templates take it: text content, tool calls with arguments as objects."""
        converted: dict = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            converted["tool_calls"] = template_tool_calls(message.tool_calls)
        for name in ("tool_call_id", "name", "reasoning_content"):
            value = getattr(message, name)
            if value is not None:
                converted[name] = value
        return converted

    def _tool_output(
        self, request: ChatCompletionRequest
    ) -> tuple[Callable[[], ToolOutput], StructuredOutputsParams | None]:
        """How this request's choices treat tool calls, and the constraint that forces them, if any."""
        choice = request.tool_choice or ("auto" if request.tools else "none")
        if not request.tools:
            if choice != "none":
                raise APIError(400, "tool_choice needs tools", "tool_choice")
            return PlainOutput, None
        if choice == "none":
            return PlainOutput, None
        if choice == "auto":
            parser = self.settings.tool_call_parser
            if parser is None:
                raise APIError(
                    400,
                    'tool_choice "auto" (the default when tools are given) needs the server started with '
                    '--enable-auto-tool-choice and --tool-call-parser; or send tool_choice "required", a named '
                    'function, or "none"',
                    "tool_choice",
                )
            tools = [t.model_dump(exclude_none=True) for t in request.tools or ()]
            return functools.partial(AutoCallsOutput, parser, request.parallel_tool_calls, tools), None
        if choice == "required":
            return RequiredCallsOutput, forced_calls_params(request.tools, choice, request.parallel_tool_calls)
        name = named_function(request.tools, choice).function.name
        return functools.partial(NamedCallOutput, name), forced_calls_params(request.tools, choice, False)

    async def create(self, request: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        deadline = self.deadline()
        lora = self.check_model(request.model)
        self.check_request(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        place = self.check_capacity()
        tool_output, forced = self._tool_output(request)
        text, ids, images = await self.render_in_thread(request, deadline)
        max_tokens = self.max_tokens_for(len(ids), request.max_completion_tokens or request.max_tokens)
        top = request.top_logprobs or 0
        logprobs = top if request.logprobs else None
        params = self.params(
            lambda: request.sampling_params(max_tokens, self.defaults, logprobs, request.prompt_logprobs)
        )
        if forced is not None:
            if params.structured_outputs is not None:
                raise APIError(
                    400,
                    "tool_choice forces a tool call, so the output cannot also follow response_format "
                    "or structured_outputs",
                    "tool_choice",
                )
            params = self.params(lambda: params.clone(structured_outputs=forced))
        request_id = random_id("chatcmpl")
        prompt = {"prompt": text, "prompt_token_ids": ids}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        first, stream = await self.start(request_id, prompt, params, request.priority, place, deadline, lora)
        choices = {i: ChoiceDeltas(tool_output(), self.settings.reasoning_parser) for i in range(request.n)}
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, first, stream, top, choices, deadline),
                media_type="text/event-stream",
            )
        final = None
        async for output in self.rest(first, stream, deadline):
            final = output
        answers, completion_tokens = [], 0
        for completion in final.outputs:
            completion_tokens += len(completion.token_ids)
            self.record(final, len(completion.token_ids), completion.finish_reason)
            deltas = choices[completion.index]
            message = merge_deltas(
                deltas.feed(completion.text) + deltas.finish(), self.settings.reasoning_parser is not None
            )
            answers.append(
                {
                    "index": completion.index,
                    "message": message,
                    "logprobs": chat_logprobs(completion, top),
                    "finish_reason": deltas.finish_reason(completion.finish_reason),
                    "stop_reason": completion.stop_reason,
                }
            )
        totals = usage(len(final.prompt_token_ids), completion_tokens)  # images expanded
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": now(),
                "model": self.response_model(request.model),
                "choices": answers,
                "usage": totals,
                **prompt_logprobs_field(request.prompt_logprobs, final),
            }
        )

    async def _stream(self, request, request_id, first, stream, top, choices, deadline) -> AsyncIterator[str]:
        created = now()
        counts: dict[int, int] = {}

        model = self.response_model(request.model)
        chunk = functools.partial(self.stream_chunk, request_id, "chat.completion.chunk", model, created)

        def choice(index: int, delta: dict, logprobs=None, finish_reason=None) -> str:
            return chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

        answered = False  # every choice has finished
        try:
            for index in range(request.n):
                yield choice(index, {"role": "assistant", "content": ""})
            prompt_tokens = len(first.prompt_token_ids)
            async for output in self.rest(first, stream, deadline):
                for completion in output.outputs:
                    counts[completion.index] = counts.get(completion.index, 0) + len(completion.token_ids)
                    deltas = choices[completion.index]
                    pieces = deltas.feed(completion.text) if completion.text else []
                    if completion.finish_reason is not None:
                        self.record(output, counts[completion.index], completion.finish_reason)
                        pieces += deltas.finish()
                    logprobs = chat_logprobs(completion, top)
                    for piece in pieces[:-1]:
                        yield choice(completion.index, piece)
                    if pieces or completion.token_ids:  # the last piece carries the step's logprobs
                        yield choice(completion.index, pieces[-1] if pieces else {}, logprobs)
                    if completion.finish_reason is not None:
                        # In a chunk of its own, as OpenAI sends it: clients close the message (a tool call's
                        # `arguments.done`) on the chunk before.
                        yield choice(completion.index, {}, None, deltas.finish_reason(completion.finish_reason))
            answered = True
            if request.stream_options and request.stream_options.include_usage:
                generated = sum(counts.values())
                yield chunk([], usage(prompt_tokens, generated))
        except APIError as exc:
            yield sse(exc.body())
        except (asyncio.CancelledError, GeneratorExit):  # the client left (Starlette cancels or closes the stream)
            if not answered:
                self.client_left()
            raise
        yield sse("[DONE]")

"""What completions and chat share: model check, request fan-out to the engine, limits, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from heteroserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from heteroserve.engine.llm_engine import PromptInput
from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.lora_modules import LoRAModules
from heteroserve.entrypoints.openai.protocol import RequestBody, SamplingFields
from heteroserve.lora.request import LoRARequest
from heteroserve.metrics.prometheus import ServerMetrics
from heteroserve.multimodal.media import MediaPolicy
from heteroserve.outputs import PoolingRequestOutput, RequestOutput
from heteroserve.pooling_params import PoolingParams
from heteroserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    served_model_names: list[str]
    max_waiting_requests: int | None = None
    request_timeout: float | None = None
    chat_template: str | None = None
    media: MediaPolicy = field(default_factory=MediaPolicy)  # where chat images may come from
    tool_call_parser: str | None = None  # set: tool_choice "auto" is enabled and parses this format
    reasoning_parser: str | None = None  # set: <think> goes to reasoning_content
    trust_request_chat_template: bool = False  # a request's chat_template is code run on the server
    chat_template_timeout: float = 5.0  # seconds one rendering may take
    max_request_body_bytes: int = 32 * 1024**2  # room for one image of --max-image-bytes' default, base64-encoded
    max_prompts_per_request: int = 256  # prompts in one completion request (each is an engine request)
    metrics_prefix: str = "both"  # /metrics names: heteroserve:*, vllm:* or both (METRICS_PREFIXES)
    lora_modules: LoRAModules = field(default_factory=LoRAModules)  # adapters served by name (--lora-modules)
    # The model as the user named it (a folder or file path, a Hugging Face id): the card's `root`, and accepted as
    # a request's `model` too, as vLLM serves a folder under its path.
    model_root: str | None = None


class Admission:
    """--max-waiting-requests: counts the requests this server has admitted that are not running yet.

    Counted here, on the event loop, rather than read from the scheduler: a burst arrives before the engine thread
    has queued any of it, so the scheduler's count lags behind what was admitted. Checking and counting are one
    synchronous call on the event loop, so no two requests can take the last place. A request stops waiting when
    the engine first schedules it (the engine thread says so through `AsyncLLMEngine.generate`'s on_running) or
    when its handler ends (it finished, was refused, or its client left), whichever comes first. A preempted
    request was admitted long ago and is not counted again.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.waiting = 0

    def admit(self) -> WaitingPlace | None:
        """The request's place in the count (None without a limit), or a 429 when the places are taken."""
        if self.limit is None:
            return None
        if self.waiting >= self.limit:
            raise APIError(429, f"too many requests waiting (limit {self.limit}); retry later")
        place = WaitingPlace(self)
        asyncio.current_task().add_done_callback(lambda _: place.leave())
        return place


class WaitingPlace:
    """One admitted request in `Admission`'s count; left once, by whichever way of leaving comes first."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.left = False
        admission.waiting += 1

    def leave(self) -> None:
        if not self.left:
            self.left = True
            self.admission.waiting -= 1


class OpenAIServing:
    def __init__(
        self, engine: AsyncLLMEngine, settings: ServerSettings, metrics: ServerMetrics, admission: Admission
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.admission = admission
        self.tokenizer = engine.model.tokenizer
        self.max_model_len = engine.model.max_model_len
        self.defaults = engine.model.sampling_defaults
        self.cut_off = False  # the SIGTERM drain's timeout has passed
        self._reads: set[asyncio.Future] = set()  # requests' waits for their next output

    def cut_off_requests(self) -> None:
        """The drain timeout passed: every request waiting for its next output ends with a 503 (a stream: an
        error event, then [DONE]) instead of a connection closed mid-answer; its engine request is aborted."""
        self.cut_off = True
        for read in self._reads:
            read.cancel()

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter the request's model names (None: the base model); 404 for a model not served here."""
        if model is None or model in self.settings.served_model_names or model == self.settings.model_root:
            return None
        lora = self.settings.lora_modules.get(model)
        if lora is None:
            adapters = self.settings.lora_modules.names()
            also = f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
            raise APIError(
                404, f"The model `{model}` does not exist; this server serves {self.model_name!r}{also}.", "model"
            )
        return lora

    def response_model(self, model: str | None) -> str:
        """The model name a response carries: the adapter's when the request named one, else the base model's."""
        return model if model is not None and self.settings.lora_modules.get(model) is not None else self.model_name

    def check_request(self, request: SamplingFields) -> None:
        """The body's undeclared fields (check_fields) and what completions and chat both refuse."""
        check_fields(request)
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
        if request.prompt_logprobs is not None and request.stream:
            raise APIError(400, "prompt_logprobs are not available with stream=true", "prompt_logprobs")

    def check_capacity(self) -> WaitingPlace | None:
        """Admits the request or answers 429 (--max-waiting-requests); hand the place to `start`."""
        return self.admission.admit()

    def max_tokens_for(self, prompt_len: int, requested: int | None) -> int:
        if prompt_len > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{prompt_len} tokens.",
                "prompt",
            )
        room = max(self.max_model_len - prompt_len, 1)
        return requested if requested is not None else self.defaults.get("max_tokens", room)

    def params(self, build) -> SamplingParams:
        try:
            return build()
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def deadline(self) -> float | None:
        """When a request arriving now must be done (time.monotonic()), streamed or not: --request-timeout."""
        timeout = self.settings.request_timeout
        return None if timeout is None else time.monotonic() + timeout

    def timed_out(self) -> APIError:
        """The 408 of a request past --request-timeout, counted as an abort by timeout."""
        self.metrics.observe_aborted("timeout")
        return APIError(408, f"the request did not finish within {self.settings.request_timeout} s")

    async def start(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams,
        priority: int,
        place: WaitingPlace | None,
        deadline: float | None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[RequestOutput | PoolingRequestOutput, AsyncIterator[RequestOutput | PoolingRequestOutput]]:
        """Starts one engine request and waits for its first output, so bad input fails before any byte is sent.
        The request leaves its waiting `place` once the engine runs it."""
        if isinstance(params, SamplingParams):  # a pooling request has neither n nor max_tokens
            self.metrics.observe_params(params.n, params.max_tokens)
        stream = self.engine.generate(
            request_id, prompt, params, priority, place.leave if place else None, lora_request
        )
        try:
            first = await self._next(stream, deadline)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        except EngineDeadError as exc:
            raise self.engine_failed(exc) from exc
        return first, stream

    async def _next(self, stream: AsyncIterator[RequestOutput], deadline: float | None) -> RequestOutput:
        """The stream's next output; past the deadline, or once the drain cuts requests off, the stream is closed,
        which aborts the engine request."""
        read = asyncio.ensure_future(anext(stream))
        if self.cut_off:
            read.cancel()
        self._reads.add(read)
        try:
            done, _ = await asyncio.wait({read}, timeout=None if deadline is None else deadline - time.monotonic())
        except asyncio.CancelledError:  # the client left
            read.cancel()
            raise
        finally:
            self._reads.discard(read)
        if read in done and not read.cancelled():
            return read.result()
        read.cancel()
        await asyncio.wait({read})  # the generator's own clean-up (the abort) runs before it is closed
        await stream.aclose()
        if self.cut_off:
            raise APIError(503, "the server is shutting down: its drain timeout passed before the request finished")
        raise self.timed_out()

    async def rest(
        self, first: RequestOutput, stream: AsyncIterator[RequestOutput], deadline: float | None
    ) -> AsyncIterator[RequestOutput]:
        output = first
        while True:
            failed = next((c for c in output.outputs if c.finish_reason == "error"), None)
            if failed is not None:  # the client's constraint could not be enforced: a 4xx, not the back end's fault
                self.metrics.observe_aborted("grammar_error")
                raise APIError(400, f"choice {failed.index}: {failed.error}; the request ended there")
            yield output
            if output.finished:
                return
            try:
                output = await self._next(stream, deadline)
            except EngineDeadError as exc:
                raise self.engine_failed(exc) from exc

    def engine_failed(self, error: EngineDeadError) -> APIError:
        """The 500 of a request the engine failed under, counted as an abort by engine error."""
        self.metrics.observe_aborted("engine_error")
        return APIError(500, str(error))

    def client_left(self) -> None:
        """Counts a streamed answer whose client went away before its end."""
        self.metrics.observe_aborted("client_disconnect")

    def stream_chunk(
        self, request_id: str, kind: str, model: str, created: int, choices: list[dict], totals: dict | None = None
    ) -> str:
        """One server-sent event of a streamed response (`kind`: text_completion or chat.completion.chunk)."""
        body = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
        if totals is not None:
            body["usage"] = totals
        return sse(body)

    def record(self, output: RequestOutput, num_output_tokens: int, finish_reason: str | None) -> None:
        self.metrics.observe_finished(output.metrics, len(output.prompt_token_ids), num_output_tokens, finish_reason)


def check_fields(body: RequestBody) -> None:
    """A field of OpenAI's or vLLM's that heteroserve would not honour is a 400 naming it (unless its value asks for
    nothing); fields neither defines are ignored, and the server log names them."""
    unknown = []
    for path, value, unhonoured in body.undeclared():
        if unhonoured is None:
            unknown.append(path)
        elif not unhonoured.asks_nothing(value):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise APIError(400, f"{path}={shown} is not supported: {unhonoured.why}", path)
    if unknown:
        logger.warning("ignoring request fields heteroserve does not know: %s", ", ".join(unknown))


def prompt_logprobs_field(asked: int | None, output: RequestOutput) -> dict:
    """vLLM's `prompt_logprobs` when asked for: per prompt token (None for the first, which has no context),
    {token id: {logprob, rank, decoded_token}} for the prompt's token and the `asked` most likely ones."""
    if asked is None:
        return {}
    entries = [
        None
        if entry is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
            if lp.rank <= asked or t == token_id  # echo may have asked the engine for more
        }
        for token_id, entry in zip(output.prompt_token_ids, output.prompt_logprobs or [], strict=False)
    ]
    return {"prompt_logprobs": entries}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


async def merge(streams: list[AsyncIterator[tuple[int, RequestOutput]]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several output streams as their items arrive."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def prompt_inputs(given: str | list, field: str) -> list[PromptInput]:
    """A body's prompt field (completions' `prompt`, embeddings' `input`) as engine prompts: a string, strings,
    token ids, or lists of token ids."""
    if isinstance(given, str):
        return [given]
    if all(isinstance(item, int) for item in given):
        return [{"prompt_token_ids": given}]
    if all(isinstance(item, list) for item in given):
        if any(not ids for ids in given):
            raise APIError(400, f"{field}: token lists must not be empty", field)
        return [{"prompt_token_ids": ids} for ids in given]
    return list(given)

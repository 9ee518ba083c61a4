"""The server's engine loop: `LLMEngine` stepped in a background thread, outputs fed to asyncio queues.

A thread rather than a process: torch releases the GIL inside its kernels, so the event loop stays
responsive while a step runs (see docs/ARCHITECTURE.md for the measurement), and one process keeps a
single copy of the weights. The loop steps while there is work and sleeps on an event when idle.

`from_config` builds the engine inside that thread too, so one thread alone ever runs torch's parallel
regions: every other thread that does (loading the model on the main thread did) gets an OpenMP team of its
own, and once libgomp manages more threads than there are cores its workers stop spinning between regions
and sleep, so that every parallel region of a step pays for waking them (docs/ARCHITECTURE.md, "The server";
the cost is in bench/README.md, "Figures behind the code's choices").
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from heteroserve.config import EngineConfig
from heteroserve.engine.input_processor import InputProcessor
from heteroserve.engine.llm_engine import LLMEngine, PromptInput
from heteroserve.lora.request import LoRARequest
from heteroserve.outputs import PoolingRequestOutput, RequestOutput
from heteroserve.pooling_params import PoolingParams
from heteroserve.sampling_params import SamplingParams
from heteroserve.worker.worker import ModelInfo

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; every request in flight gets this error."""


@dataclass
class _Add:
    request_id: str
    prompt: PromptInput
    params: SamplingParams | PoolingParams
    priority: int
    accepted: asyncio.Future
    outputs: asyncio.Queue
    on_running: Callable[[], None] | None
    lora_request: LoRARequest | None


@dataclass
class _Abort:
    """Aborts the request only while `outputs` is still its stream: a refused request (an id already in use)
    must not abort the other request that holds its id."""

    request_id: str
    outputs: asyncio.Queue


class AsyncLLMEngine:
    engine: LLMEngine

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        """`engine`, or a function that builds it (called in the engine thread, before it returns here)."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._unstarted: dict[str, tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = {}  # told when running
        self._stopping = False
        self.dead_error: BaseException | None = None
        self.num_steps = 0
        build = engine if callable(engine) else lambda: engine
        built: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._build_and_run, args=(build, built), name="heteroserve-engine", daemon=True
        )
        self._thread.start()
        failure = built.get()  # None once the engine thread has set self.engine
        if failure is not None:
            raise failure

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(lambda: LLMEngine(config))

    @property
    def model(self) -> ModelInfo:
        """What the workers loaded: name, tokenizer, max_model_len, vocabulary, task."""
        return self.engine.model

    @property
    def processor(self) -> InputProcessor:
        """Tokenizing, pooling prompts, LoRA checks: thread-safe, for a server's own threads."""
        return self.engine.processor

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead_error is None

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        on_running: Callable[[], None] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """Queues a request and yields its outputs; a bad request raises ValueError before the first yield.

        Leaving early, however it happens (the iterator closed or cancelled while the engine is still to accept
        the request, or at any later point), aborts the request and frees its blocks. `on_running` is called on
        this event loop once the engine first schedules the request (`LLMEngine.is_waiting` turns false).
        With PoolingParams (a pooling model) it yields one PoolingRequestOutput.
        """
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running: {self.dead_error!r}")
        loop = asyncio.get_running_loop()
        accepted, outputs = loop.create_future(), asyncio.Queue()
        self._send(_Add(request_id, prompt, params, priority, accepted, outputs, on_running, lora_request))
        finished = False
        try:
            await accepted  # raises the engine's ValueError for bad input
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # queued after the _Add, so the engine thread sees the request before its abort
                self._send(_Abort(request_id, outputs))

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    def _send(self, message: _Add | _Abort) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _build_and_run(self, build: Callable[[], LLMEngine], built: queue.SimpleQueue) -> None:
        try:
            self.engine = build()
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor, which raises it
            built.put(exc)
            return
        built.put(None)
        self._run()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self.num_steps += 1
                self._deliver_step(outputs)
                if self._unstarted:
                    self._announce_running()
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting client
            logger.exception("engine loop failed")
            self.dead_error = exc
            error = EngineDeadError(f"the engine failed: {exc!r}")
            for request_id in list(self._streams):
                self._deliver(request_id, error, True)
            self._fail_inbox(error)

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Abort):
                stream = self._streams.get(message.request_id)
                if stream is not None and stream[1] is message.outputs:
                    self.engine.abort_request(message.request_id)
                    self._unstarted.pop(message.request_id, None)
                continue
            loop = message.accepted.get_loop()
            try:
                self.engine.add_request(
                    message.request_id,
                    message.prompt,
                    message.params,
                    message.priority,
                    lora_request=message.lora_request,
                )
            except ValueError as exc:
                loop.call_soon_threadsafe(_settle, message.accepted, exc)
                continue
            self._streams[message.request_id] = (loop, message.outputs)
            if message.on_running is not None:
                self._unstarted[message.request_id] = (loop, message.on_running)
            loop.call_soon_threadsafe(_settle, message.accepted, None)

    def _announce_running(self) -> None:
        """Calls `on_running` of each request the last step scheduled for the first time (or finished). Only
        requests that asked are looked at, so a server without a waiting limit pays nothing here."""
        for request_id in [r for r in self._unstarted if not self.engine.is_waiting(r)]:
            loop, on_running = self._unstarted.pop(request_id)
            loop.call_soon_threadsafe(on_running)

    def _fail_inbox(self, error: BaseException) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Add):
                message.accepted.get_loop().call_soon_threadsafe(_settle, message.accepted, error)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """One wake-up of each event loop per step, however many requests it served."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            target = (
                self._streams.pop(output.request_id, None) if output.finished else self._streams.get(output.request_id)
            )
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException, last: bool) -> None:
        target = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if target is not None:
            loop, outputs = target
            loop.call_soon_threadsafe(outputs.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue_, output in items:
        queue_.put_nowait(output)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)

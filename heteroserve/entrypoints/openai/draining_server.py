"""uvicorn's server with a SIGTERM drain, shared by `heteroserve serve` and `heteroserve gateway`."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from heteroserve.entrypoints.openai.gate import ServerState

logger = logging.getLogger("heteroserve.server")


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: readiness turns 503 and new requests are refused, in-flight ones finish
    (bounded by the drain timeout, when the state's at_drain_timeout callbacks run), then uvicorn shuts down and
    the process exits 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_task is not None:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        logger.info("received %s: draining", signal.Signals(sig).name)
        self.state.draining = True
        self._drain_task = asyncio.get_event_loop().create_task(self._drain(sig, frame))

    async def _drain(self, sig: int, frame) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while self.state.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.state.in_flight:
            logger.warning("drain timeout: %d requests still in flight are cut off", self.state.in_flight)
            for cut_off in self.state.at_drain_timeout:
                cut_off()
        self.should_exit = True  # not handle_exit: uvicorn would re-raise the signal and the exit code be -15

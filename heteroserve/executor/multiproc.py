"""Ranks as worker processes (on this node, and on others started with `--node-rank`).

The engine waits for rank 0's answer and for the exit of any local worker at once, so a worker that
dies turns into an exception here instead of a hang; a rank on another node that dies breaks rank 0's
collective, and rank 0 reports that.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from heteroserve.config import EngineConfig
from heteroserve.executor.base import Executor, WorkerDiedError
from heteroserve.executor.preflight import check_model_split
from heteroserve.executor.worker_process import SHUTDOWN, free_port, start_node_workers
from heteroserve.platforms import resolve_platform
from heteroserve.worker.step_wire import StepEncoder

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self._encoder = StepEncoder()
        check_model_split(config)
        self.platform = resolve_platform(config.device.device)
        parallel = config.parallel
        port = parallel.master_port or free_port()
        pipes = [multiprocessing.get_context("spawn").Pipe() for _ in range(parallel.ranks_per_node)]
        self._reports = [ours for ours, _ in pipes]
        self._conn = self._reports[0]  # rank 0: steps, answers and its failure; the others: their failure
        self.processes = start_node_workers(config, 0, port, [theirs for _, theirs in pipes])
        for _, theirs in pipes:
            theirs.close()
        self._dead: BaseException | None = None
        self._finalizer = weakref.finalize(self, _stop, self._reports, self.processes)
        if parallel.nnodes > 1:
            logger.info("waiting for %d more node(s) to join %s:%d", parallel.nnodes - 1, parallel.master_addr, port)
        self.model_info = self._receive()

    def _execute(self, scheduled, released):
        if self._dead is not None:
            raise WorkerDiedError(f"the workers have failed: {self._dead}") from self._dead
        try:
            self._conn.send(self._encoder.encode(scheduled, released))
        except OSError as exc:
            self._fail(WorkerDiedError(f"cannot reach worker rank 0: {exc}"))
        return self._receive()

    def _receive(self):
        """Rank 0's next answer, or an exception as soon as a rank reports an error or any worker exits."""
        ready = wait([*self._reports, *(p.sentinel for p in self.processes)])
        if self._conn in ready:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                kind, payload = "error", None
            if kind in ("ok", "ready"):
                return payload
            if payload is not None:
                self._fail(payload)
        for process in self.processes:  # a worker that hung up is about to exit: learn its exit code
            process.join(timeout=1.0)
        reported = self._reported_error()
        if reported is not None:
            self._fail(reported)
        exited = [p for p in self.processes if not p.is_alive()]
        detail = ", ".join(f"{p.name} (pid {p.pid}) exit code {p.exitcode}" for p in exited) or "rank 0 hung up"
        self._fail(WorkerDiedError(f"a worker process died: {detail}"))

    def _reported_error(self) -> BaseException | None:
        """The first failure a rank reported before exiting, if any did."""
        for conn in self._reports:
            try:
                if conn.poll(0):
                    kind, payload = conn.recv()
                    if kind == "error":
                        return payload
            except (EOFError, OSError):
                continue
        return None

    def _fail(self, error: BaseException):
        self._dead = error
        for process in self.processes:  # the survivors may be stuck in a collective with the dead one
            if process.is_alive():
                process.terminate()
        self.shutdown()
        raise error

    def shutdown(self) -> None:
        self._finalizer()


def _stop(reports: list[Connection], processes: list[BaseProcess]) -> None:
    """Asks rank 0 to stop every rank, then ends whatever is left."""
    with contextlib.suppress(OSError):
        reports[0].send(SHUTDOWN)
    for process in processes:
        process.join(timeout=JOIN_TIMEOUT_S)
        if process.is_alive():
            process.terminate()
            process.join(timeout=JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in reports:
        conn.close()

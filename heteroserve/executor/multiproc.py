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
from heteroserve.executor.worker_process import SHUTDOWN, free_port, start_node_workers
from heteroserve.platforms import resolve_platform

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.platform = resolve_platform(config.device.device)
        parallel = config.parallel
        port = parallel.master_port or free_port()
        self._conn, worker_end = multiprocessing.get_context("spawn").Pipe()
        self.processes = start_node_workers(config, 0, port, worker_end)
        worker_end.close()
        self._dead: BaseException | None = None
        self._finalizer = weakref.finalize(self, _stop, self._conn, self.processes)
        if parallel.nnodes > 1:
            logger.info("waiting for %d more node(s) to join %s:%d", parallel.nnodes - 1, parallel.master_addr, port)
        self.model_info = self._receive()

    def _execute(self, scheduled, released):
        from heteroserve.worker.worker import Step

        if self._dead is not None:
            raise WorkerDiedError(f"the workers have failed: {self._dead}") from self._dead
        try:
            self._conn.send(Step(scheduled, released))
        except OSError as exc:
            self._fail(WorkerDiedError(f"cannot reach worker rank 0: {exc}"))
        return self._receive()

    def _receive(self):
        """Rank 0's next answer, or an exception as soon as rank 0 reports an error or any worker exits."""
        sentinels = {p.sentinel: p for p in self.processes}
        ready = wait([self._conn, *sentinels])
        if self._conn in ready:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                kind, payload = "error", None
            if kind == "ok" or kind == "ready":
                return payload
            if payload is not None:
                self._fail(payload)
        for process in self.processes:  # a worker that hung up is about to exit: learn its exit code
            process.join(timeout=1.0)
        exited = [p for p in self.processes if not p.is_alive()]
        detail = ", ".join(f"{p.name} (pid {p.pid}) exit code {p.exitcode}" for p in exited) or "rank 0 hung up"
        self._fail(WorkerDiedError(f"a worker process died: {detail}"))

    def _fail(self, error: BaseException):
        self._dead = error
        for process in self.processes:  # the survivors may be stuck in a collective with the dead one
            if process.is_alive():
                process.terminate()
        self.shutdown()
        raise error

    def shutdown(self) -> None:
        self._finalizer()


def _stop(conn: Connection, processes: list[BaseProcess]) -> None:
    """Asks rank 0 to stop every rank, then ends whatever is left."""
    with contextlib.suppress(OSError):
        conn.send(SHUTDOWN)
    for process in processes:
        process.join(timeout=JOIN_TIMEOUT_S)
        if process.is_alive():
            process.terminate()
            process.join(timeout=JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
    conn.close()

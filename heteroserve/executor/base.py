"""The executor interface the engine talks to: it never sees a tensor, a process or a process group."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from heteroserve.core.scheduler import SchedulerOutput
    from heteroserve.platforms import Platform
    from heteroserve.worker.model_runner import StepResult
    from heteroserve.worker.worker import ModelInfo


class WorkerDiedError(RuntimeError):
    """A worker failed or exited; the engine cannot continue (its KV cache share is gone)."""


class Executor(ABC):
    model_info: ModelInfo
    platform: Platform  # in-process: the one the model runs on; otherwise the engine process's copy

    def __init__(self) -> None:
        self._released: list[str] = []

    def release(self, request_id: str) -> None:
        """Forgets a finished request's per-request state (its sampling generator) with the next step."""
        self._released.append(request_id)

    def execute(self, scheduled: SchedulerOutput) -> dict[str, StepResult]:
        released, self._released = self._released, []
        return self._execute(scheduled, released)

    @abstractmethod
    def _execute(self, scheduled: SchedulerOutput, released: list[str]) -> dict[str, StepResult]: ...

    def shutdown(self) -> None:  # noqa: B027 - nothing to stop in-process
        """Stops the workers; safe to call twice."""

"""One rank in the engine's own process: no process group, no serialisation."""

from __future__ import annotations

from heteroserve.config import EngineConfig
from heteroserve.executor.base import Executor
from heteroserve.worker.worker import Step, Worker


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.worker = Worker(config)
        self.model_info = self.worker.info
        self.platform = self.worker.platform

    def _execute(self, scheduled, released):
        return self.worker.execute(Step(scheduled, released))

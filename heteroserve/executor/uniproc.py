"""One rank in the engine's own process: no process group, no serialisation. It receives the same step deltas as
worker processes do (worker/step_wire.py), so the rank holds its own copy of each request, never the engine's."""

from __future__ import annotations

from heteroserve.config import EngineConfig
from heteroserve.executor.base import Executor
from heteroserve.worker.step_wire import StepEncoder
from heteroserve.worker.worker import Worker


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.worker = Worker(config)
        self.model_info = self.worker.info
        self.platform = self.worker.platform
        self._encoder = StepEncoder()

    def _execute(self, scheduled, released):
        return self.worker.execute(self._encoder.encode(scheduled, released, wait_for_masks=False))

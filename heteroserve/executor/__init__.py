"""Executors: how the engine reaches its workers (in-process, worker processes, or Ray actors)."""

from __future__ import annotations

from heteroserve.config import EngineConfig
from heteroserve.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    """The executor `config.parallel` asks for; each imports its machinery (torch, Ray) only when chosen."""
    backend = config.parallel.executor_backend
    if backend == "uni":
        from heteroserve.executor.uniproc import InProcessExecutor

        return InProcessExecutor(config)
    if backend == "ray":
        from heteroserve.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from heteroserve.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)

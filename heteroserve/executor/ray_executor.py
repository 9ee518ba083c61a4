"""Ranks as Ray actors, placed by a placement group (as vLLM places its workers): `ray start` on each
machine, then `--distributed-executor-backend ray` on the head. Every actor gets each step; the
sampling rank's return value is the step's result. torch.distributed still carries the collectives."""

from __future__ import annotations

import os

from heteroserve.config import EngineConfig
from heteroserve.executor.base import Executor, WorkerDiedError
from heteroserve.executor.preflight import check_model_split
from heteroserve.platforms import resolve_platform
from heteroserve.worker.step_wire import StepEncoder


class RayWorker:
    """The actor: a `Worker` built once its rank and the rendezvous address are known."""

    def __init__(self) -> None:
        self.worker = None

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        from heteroserve.executor.worker_process import free_port

        return ray.util.get_node_ip_address(), free_port()

    def start(self, config: EngineConfig, rank: int, local_rank: int, address: str, port: int):
        from heteroserve.worker.worker import Worker

        self.worker = Worker(config, rank, local_rank, address, port)
        return self.worker.info if rank == 0 else None

    def execute(self, step):
        return self.worker.execute(step)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self._encoder = StepEncoder()
        check_model_split(config)
        self.platform = resolve_platform(config.device.device)
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as exc:
            raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'heteroserve[ray]'") from exc
        self._ray = ray
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True)
        world = config.parallel.world_size
        resource = self.platform.ray_resource
        self._group = placement_group([{resource: 1}] * world, strategy="PACK")
        ray.get(self._group.ready())
        if resource == "CPU":
            actor_class = ray.remote(num_cpus=1)(RayWorker)
        elif resource == "GPU":
            actor_class = ray.remote(num_cpus=0, num_gpus=1)(RayWorker)
        else:  # a custom resource, e.g. NPU with Ray's Ascend support
            actor_class = ray.remote(num_cpus=0, resources={resource: 1})(RayWorker)
        self.actors = [
            actor_class.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=rank),
                runtime_env={"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}},
            ).remote()
            for rank in range(world)
        ]
        address, port = ray.get(self.actors[0].rendezvous_address.remote())
        node_of = ray.get([a.rendezvous_address.remote() for a in self.actors])
        local_ranks = [sum(1 for other in node_of[:rank] if other[0] == ip) for rank, (ip, _) in enumerate(node_of)]
        starts = [
            actor.start.remote(config, rank, local_ranks[rank], address, port) for rank, actor in enumerate(self.actors)
        ]
        self.model_info = self._get(starts)[0]
        self._sampler = (config.parallel.pipeline_parallel_size - 1) * config.parallel.tensor_parallel_size

    def _get(self, refs):
        try:
            return self._ray.get(refs)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.RayTaskError) as exc:
            self.shutdown()
            cause = exc.cause if isinstance(exc, self._ray.exceptions.RayTaskError) else exc
            if isinstance(cause, ValueError):
                raise ValueError(str(cause)) from exc
            raise WorkerDiedError(f"a Ray worker failed: {exc}") from exc

    def _execute(self, scheduled, released):
        step = self._ray.put(self._encoder.encode(scheduled, released))
        return self._get([actor.execute.remote(step) for actor in self.actors])[self._sampler]

    def shutdown(self) -> None:
        for actor in getattr(self, "actors", []):
            self._ray.kill(actor)
        self.actors = []
        if getattr(self, "_group", None) is not None:
            self._ray.util.remove_placement_group(self._group)
            self._group = None

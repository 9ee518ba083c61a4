"""Worker processes: starting a node's ranks, and the loop each rank runs.

Rank 0 takes each step from the engine through a pipe and broadcasts it to every rank over the gloo
control group, so ranks on other nodes need nothing but the TCP rendezvous. The sampling rank (tensor
rank 0 of the last pipeline stage) sends its results to rank 0, which answers the engine. While the
engine is idle rank 0 broadcasts a ping now and then, so the waiting ranks' collectives never time out.
Any failure ends the process with a non-zero exit code; rank 0 first tells the engine what went wrong.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import sys
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from heteroserve.config import EngineConfig

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 30.0
SHUTDOWN = "shutdown"
PING = "ping"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(ranks_on_node: int) -> int:
    """This node's cores (those the process may run on) shared evenly by its ranks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // ranks_on_node)


@contextlib.contextmanager
def _child_environment(variables: dict[str, str]):
    """Environment the spawned interpreters start with (OpenMP reads it when torch loads, before our code)."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_node_workers(
    config: EngineConfig, node_rank: int, master_port: int, reports: list[Connection] | None
) -> list[BaseProcess]:
    """Starts this node's ranks. On the head, `reports` are their ends of the engine's pipes: every rank
    reports its failure there, and rank 0 also takes the steps and answers through its pipe."""
    parallel = config.parallel
    per_node = parallel.ranks_per_node
    threads = threads_per_rank(per_node)
    context = multiprocessing.get_context("spawn")
    processes = []
    environment = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(threads)}
    with _child_environment(environment):
        for local_rank in range(per_node):
            rank = node_rank * per_node + local_rank
            process = context.Process(
                target=run_worker,
                args=(config, rank, local_rank, master_port, threads, reports[local_rank] if reports else None),
                name=f"heteroserve-rank{rank}",
                daemon=True,
            )
            process.start()
            processes.append(process)
    return processes


def run_worker(
    config: EngineConfig, rank: int, local_rank: int, master_port: int, threads: int, report: Connection | None
) -> None:
    """A worker process's main function."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    import torch

    torch.set_num_threads(threads)  # HETEROSERVE_NUM_THREADS, if set, overrides this in configure_process
    from heteroserve.worker.worker import Worker

    worker = None
    try:
        worker = Worker(config, rank, local_rank, config.parallel.master_addr, master_port)
        driver = report if rank == 0 else None
        if driver is not None:
            driver.send(("ready", worker.info))
        _serve_steps(worker, driver)
    except BaseException as exc:  # noqa: BLE001 - the engine must hear why, then this process ends
        logger.exception("rank %d failed", rank)
        if report is not None:
            with contextlib.suppress(OSError):
                report.send(("error", _portable(exc, rank)))
        sys.exit(1)
    finally:
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.close()


def _serve_steps(worker, driver: Connection | None) -> None:
    import torch.distributed as dist

    groups = worker.groups
    while True:
        message = [_next_message(driver)] if driver is not None else [None]
        if groups.world_size > 1:
            dist.broadcast_object_list(message, src=0, group=groups.control_group)
        step = message[0]
        if step == SHUTDOWN:
            return
        if step == PING:
            continue
        results = worker.execute(step)
        if groups.sampler_rank != 0:
            if groups.samples:
                dist.send_object_list([results], dst=0, group=groups.control_group)
            elif groups.rank == 0:
                box = [None]
                dist.recv_object_list(box, src=groups.sampler_rank, group=groups.control_group)
                results = box[0]
        if driver is not None:
            driver.send(("ok", results))


def _next_message(driver: Connection):
    try:
        if not driver.poll(PING_INTERVAL_S):
            return PING
        return driver.recv()
    except (EOFError, OSError):  # the engine is gone
        return SHUTDOWN


def _portable(exc: BaseException, rank: int) -> BaseException:
    """The exception as the engine should raise it: configuration errors keep their type."""
    if isinstance(exc, ValueError):
        return ValueError(str(exc))
    return RuntimeError(f"worker rank {rank} failed: {type(exc).__name__}: {exc}")


def run_node(config: EngineConfig) -> int:
    """A node other than the head (`--node-rank N`): runs its ranks until the head shuts them down."""
    parallel = config.parallel
    processes = start_node_workers(config, parallel.node_rank, parallel.master_port, None)
    logger.info(
        "node %d of %d: ranks %d..%d joining %s:%d",
        parallel.node_rank,
        parallel.nnodes,
        parallel.node_rank * parallel.ranks_per_node,
        (parallel.node_rank + 1) * parallel.ranks_per_node - 1,
        parallel.master_addr,
        parallel.master_port,
    )
    for process in processes:
        process.join()
    failed = [p.name for p in processes if p.exitcode]
    if failed:
        logger.error("workers failed: %s", ", ".join(failed))
    return 1 if failed else 0

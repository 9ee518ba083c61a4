"""The C++ kernels' own thread pool (csrc/thread_pool.h): results that do not depend on the thread count or on
who calls, threads that sleep when idle, a forked child that still computes, and the platform's settings."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from heteroserve.platforms.cpu import kernels as cpu_kernels


@pytest.fixture(scope="module")
def library() -> None:
    if not cpu_kernels.load_library():
        pytest.skip("the C++ kernels cannot be built here (see the warning logged by cpu_kernels)")


@pytest.fixture
def restore_pool(library):
    threads, spin_us = torch.ops.heteroserve.kernel_thread_settings()
    yield
    torch.ops.heteroserve.set_kernel_threads(threads, spin_us)


def kernel_outputs(gen: torch.Generator) -> list[torch.Tensor]:
    """A GEMM over many panels, prompt attention over many heads and a fused row operator: each splits its work
    over the pool's threads."""
    w = torch.randn(200, 96, generator=gen)
    x = torch.randn(37, 96, generator=gen)
    packed = torch.ops.heteroserve.pack_linear_weight(w)
    q, k, v = (torch.randn(70, 8, 64, generator=gen) for _ in range(3))
    return [
        torch.ops.heteroserve.packed_linear(x, packed, 200, None),
        torch.ops.heteroserve.prefill_attention(q, k, v, None, 0.125),
        torch.ops.heteroserve.rms_norm(x, torch.randn(96, generator=gen), 1e-6),
    ]


def test_results_are_bit_identical_at_every_thread_count(restore_pool):
    """Chunks are independent ranges of outputs, so the thread count must not move a single bit (the engine's
    batch invariance relies on it); the products are checked against torch too, so the kernels ran."""
    outputs = {}
    for threads in (1, 2, 3, 5):
        torch.ops.heteroserve.set_kernel_threads(threads, 50)
        assert torch.ops.heteroserve.kernel_thread_settings() == [threads, 50]
        outputs[threads] = kernel_outputs(torch.Generator().manual_seed(0))
    for threads, result in outputs.items():
        for got, want in zip(result, outputs[1], strict=True):
            assert torch.equal(got, want), f"{threads} threads changed the result"
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(200, 96, generator=gen), torch.randn(37, 96, generator=gen)
    torch.testing.assert_close(outputs[2][0], x @ w.T, rtol=1e-5, atol=1e-4)


def test_two_callers_at_once_both_get_their_results(restore_pool):
    """A second Python thread calling a kernel while the pool runs another job runs its own loop alone."""
    torch.ops.heteroserve.set_kernel_threads(2, 200)
    expected = kernel_outputs(torch.Generator().manual_seed(1))
    failures: list[str] = []

    def call_many() -> None:
        for _ in range(30):
            got = kernel_outputs(torch.Generator().manual_seed(1))
            if not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
                failures.append("a result changed")

    callers = [threading.Thread(target=call_many) for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=300)
    assert not any(caller.is_alive() for caller in callers), "a caller hung"
    assert failures == []


def running_threads() -> list[int]:
    """Ids of this process's threads that are running or runnable, the caller's excluded."""
    me, running = threading.get_native_id(), []
    for task in Path("/proc/self/task").iterdir():
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "R" and int(task.name) != me:
            running.append(int(task.name))
    return running


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads thread states from /proc")
def test_idle_pool_threads_sleep_instead_of_spinning(restore_pool):
    """A pool thread spins for its budget after a job and then sleeps: an idle engine leaves the cores to
    whatever else runs there (a test process, a second server)."""
    torch.ops.heteroserve.set_kernel_threads(4, 1000)
    kernel_outputs(torch.Generator().manual_seed(2))
    time.sleep(0.2)
    samples = [running_threads() for _ in range(20)]
    assert all(sample == [] for sample in samples), f"threads still running 0.2 s after the last job: {samples}"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_computes_with_a_pool_of_its_own(restore_pool):
    """fork() copies the pool's memory but not its threads; the child must not wait for workers it lacks. The
    child calls only our GEMM on the parent's tensors: torch's own OpenMP team cannot run in a forked child."""
    torch.ops.heteroserve.set_kernel_threads(2, 200)
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(200, 96, generator=gen), torch.randn(37, 96, generator=gen)
    packed = torch.ops.heteroserve.pack_linear_weight(w)
    expected = torch.ops.heteroserve.packed_linear(x, packed, 200, None)
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 when its product equals the parent's
        os._exit(0 if torch.equal(torch.ops.heteroserve.packed_linear(x, packed, 200, None), expected) else 1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the forked child hung in a kernel")


def test_the_platform_sets_the_pool_from_the_environment(library):
    """HETEROSERVE_NUM_THREADS and HETEROSERVE_KERNEL_SPIN_US decide the pool whatever OpenMP's variables say,
    and `heteroserve env` reports them."""
    script = (
        "import torch\n"
        "from heteroserve.platforms.cpu.platform import CpuPlatform\n"
        "platform = CpuPlatform(); platform.configure_process()\n"
        "print(torch.ops.heteroserve.kernel_thread_settings(), torch.get_num_threads())\n"
        "d = platform.describe(); print(d['kernel_threads'], d['kernel_spin_us'])\n"
    )
    env = {
        **os.environ,
        "HETEROSERVE_NUM_THREADS": "3",
        "HETEROSERVE_KERNEL_SPIN_US": "77",
        "OMP_WAIT_POLICY": "ACTIVE",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:2] == ["[3, 77] 1", "3 77"]  # torch's team waits for assign_threads


def test_every_engine_of_a_process_and_its_peers_get_the_same_threads(library):
    """A second engine in the process (after the first gave torch one thread), the bench's peers and a vision
    tower's torch operators all get the process's thread count."""
    script = (
        "import torch\n"
        "torch.set_num_threads(3)\n"
        "from heteroserve.platforms.cpu.platform import CpuPlatform\n"
        "from heteroserve.bench.peers.vllm_peer import vllm_environment\n"
        "from heteroserve.platforms.cpu.platform import torch_at_process_threads\n"
        "for _ in range(2):\n"
        "    platform = CpuPlatform(); platform.configure_process(); platform.assign_threads(torch.float32)\n"
        "    print(torch.ops.heteroserve.kernel_thread_settings()[0], torch.get_num_threads())\n"
        "with platform.torch_operators():\n"
        "    print(torch.get_num_threads())\n"
        "with torch_at_process_threads():\n"
        "    print(torch.get_num_threads())\n"
        "print(torch.get_num_threads(), vllm_environment()['VLLM_CPU_OMP_THREADS_BIND'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HETEROSERVE_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:5] == ["3 1", "3 1", "3", "3", "1 0-2"]

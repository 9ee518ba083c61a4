"""Requests' own chat templates (--trust-request-chat-template) rendered in worker processes, each under a memory
cap and killed at its deadline.

The checks compiled into templates (chat_template.py) stop loops and growing values, but not one operation that
builds its whole result at once: `'%0999999999d' % 1`, `'x'|center(300000000)` or `'x'|indent(300000000)` ran for
40 s in the server, held its threads, and left it 1 GB larger. A worker runs such a step where it hurts nobody: its
address space is capped (the step fails with MemoryError) and past the deadline it is killed and replaced. The
server's own templates stay in its threads, where a rendering costs no inter-process round trip.

A worker reads one JSON line per rendering on stdin and answers one on stdout. It is a fresh interpreter that
imports chat_template.py and jinja2 only, not the heteroserve package (whose __init__ loads torch and the engine:
seconds and hundreds of MB per worker), and it exits when the server closes its stdin (the server exiting does).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import resource
import selectors
import subprocess
import sys
import time
from pathlib import Path

from heteroserve.entrypoints.openai.chat_template import (
    TemplateJob,
    TemplateTimeout,
    TemplateTooLarge,
    render_job,
)

logger = logging.getLogger(__name__)
# The memory cap needs RLIMIT_AS and /proc/self/status (the address space a worker starts from).
MEMORY_CAP_AVAILABLE = sys.platform.startswith("linux")
# A worker may grow by this much plus MEMORY_BYTES_PER_CHAR per character of the longest prompt: room to decode a
# request (up to --max-request-body-bytes), build the longest prompt (4 bytes a character at worst) and encode it
# as JSON (up to 12 bytes a character), twice over.
MEMORY_BASE_BYTES = 256 * 1024**2
MEMORY_BYTES_PER_CHAR = 32
# How long past a rendering's deadline the server waits for the worker's own TemplateTimeout before killing it.
KILL_GRACE_S = 0.5
_PACKAGE_FOLDER = str(Path(__file__).resolve().parents[2])
# Registers the heteroserve package's folder without running its __init__, then serves (argv: folder, memory cap).
_BOOTSTRAP = (
    "import sys, types\n"
    "package = types.ModuleType('heteroserve')\n"
    "package.__path__ = [sys.argv[1]]\n"
    "sys.modules['heteroserve'] = package\n"
    "from heteroserve.entrypoints.openai.template_workers import serve\n"
    "serve(int(sys.argv[2]))\n"
)


class TemplateWorkers:
    """`count` worker processes; `render` takes an idle one, so it blocks its thread (never the event loop) until
    a worker answers or is killed. A worker that was killed, died or ran out of memory is replaced at once."""

    def __init__(self, count: int, max_chars: int) -> None:
        self.max_chars = max_chars
        self.memory_bytes = MEMORY_BASE_BYTES + MEMORY_BYTES_PER_CHAR * max_chars
        if not MEMORY_CAP_AVAILABLE:
            logger.warning("request chat templates render without a memory cap here (it needs Linux's RLIMIT_AS)")
        self.idle: queue.SimpleQueue[subprocess.Popen] = queue.SimpleQueue()
        for _ in range(count):
            self.idle.put(self._start())

    def render(self, job: TemplateJob, timeout_s: float) -> str:
        """The prompt text, rendered by a worker. Raises TemplateTimeout past `timeout_s`, TemplateTooLarge past
        max_chars or the memory cap, and ValueError for a template that cannot be applied."""
        worker = self.idle.get()
        reusable = False
        try:
            reply = self._ask(worker, job, timeout_s)
            reusable = reply.get("error") != "out_of_memory"
        finally:
            if not reusable:
                _stop(worker)
                worker = self._start()
            self.idle.put(worker)
        error = reply.get("error")
        if error == "timeout":
            raise TemplateTimeout("the chat template did not finish in time")
        if error == "too_large":
            raise TemplateTooLarge(reply["message"])
        if error == "out_of_memory":
            megabytes = self.memory_bytes // 1024**2
            raise TemplateTooLarge(f"values needing more than the {megabytes} MiB of memory a request's template has")
        if error is not None:
            raise ValueError(reply["message"])
        return reply["text"]

    def _start(self) -> subprocess.Popen:
        # stderr is the server's: a worker's traceback lands in the server log.
        command = [sys.executable, "-c", _BOOTSTRAP, _PACKAGE_FOLDER, str(self.memory_bytes)]
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)

    def _ask(self, worker: subprocess.Popen, job: TemplateJob, timeout_s: float) -> dict:
        """The worker's answer. Raises TemplateTimeout when none came by the deadline (plus KILL_GRACE_S, for the
        worker's own timeout to answer first), and ValueError when the worker died."""
        deadline = time.monotonic() + timeout_s + KILL_GRACE_S
        request = {"job": vars(job), "timeout_s": timeout_s, "max_chars": self.max_chars}
        try:
            worker.stdin.write(json.dumps(request).encode() + b"\n")
            line = _read_line(worker.stdout.fileno(), deadline)
        except BrokenPipeError:
            line = b""
        if line is None:
            raise TemplateTimeout("the chat template did not finish in time")
        if not line:
            raise ValueError(f"the process rendering the chat template died (exit code {worker.wait()})")
        return json.loads(line)


def _read_line(fd: int, deadline: float) -> bytes | None:
    """One line from `fd`; None at the deadline, b"" at the end of the file. A worker writes nothing but its
    answers, one line per rendering, so the line ends with the last byte read."""
    chunks: list[bytes] = []
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while not chunks or not chunks[-1].endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b""
            chunks.append(chunk)
    return b"".join(chunks)


def _stop(worker: subprocess.Popen) -> None:
    worker.kill()
    worker.wait()
    worker.stdin.close()
    worker.stdout.close()


def serve(memory_bytes: int) -> None:
    """A worker's loop: caps its own address space at what it uses now plus `memory_bytes`, then renders each
    request it reads, until its stdin closes."""
    if MEMORY_CAP_AVAILABLE:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = _address_space_bytes() + memory_bytes
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    answers = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers on the answers' pipe
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            reply = {"text": render_job(TemplateJob(**request["job"]), request["timeout_s"], request["max_chars"])}
        except TemplateTimeout:
            reply = {"error": "timeout"}
        except TemplateTooLarge as exc:
            reply = {"error": "too_large", "message": str(exc)}
        except MemoryError:
            reply = {"error": "out_of_memory"}
        except Exception as exc:  # jinja2's errors and the template's own raise_exception
            reply = {"error": "invalid", "message": str(exc)}
        answers.write(json.dumps(reply).encode() + b"\n")
        answers.flush()


def _address_space_bytes() -> int:
    """This process's virtual memory size (Linux's VmSize)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmSize:")).split()[1]) * 1024

"""What loading a model leaves behind in host memory, given back once the weights are in place.

Converting a checkpoint (a GGUF file's blocks into our kernels' layouts, a float checkpoint packed) maps the file
and allocates temporaries. The mapping lives as long as the parsed reader (the loader keeps it for the engine's
several reads of the file), and glibc keeps the heap that the temporaries freed for reuse. Both count in the
process's resident memory: a 1.3 GB Q4_K_M mixture of experts served at 5.1 GB resident, 2.3 GB once both are
given back (bench/results/moe-memory-*).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

from heteroserve.model.loader.gguf_loader import forget_open_files


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def release_load_memory() -> None:
    """Unmaps the files the loader read and returns the heap it freed to the system (glibc's malloc_trim; other C
    libraries keep theirs)."""
    forget_open_files()
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)

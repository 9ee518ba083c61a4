"""SmolLM2's 120 4-bit projections through CpuInt4Weight.matmul (whatever this tree routes them to), by rows:
median and min ms over ROUNDS rounds."""

import inspect
import os
import statistics
import sys
import time

if os.environ.get("TREE"):  # run another tree's heteroserve: drop the editable install's finder
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, os.environ["TREE"])
import torch

import heteroserve
from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.int4 import CpuInt4Weight
from heteroserve.quantization.int4 import quantize_int4

assert cpu_kernels.load_library()
torch.manual_seed(0)
bf16 = bool(int(os.environ.get("BF16", "1")))
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
before = "bf16_gemm" in inspect.signature(CpuInt4Weight.pack).parameters  # the tree before: large batches in bfloat16
pack = (lambda w: CpuInt4Weight.pack(w, bf16)) if before else CpuInt4Weight.pack
layers = [[pack(quantize_int4(torch.randn(n, k) * 0.05)) for n, k in shapes] for _ in range(30)]
rounds = int(os.environ.get("ROUNDS", "7"))
res = []
for rows in [int(r) for r in sys.argv[1:]]:
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    times = []
    for i in range(rounds + 1):
        t = time.perf_counter()
        for layer in layers:
            for w in layer:
                w.matmul(xs[w.shape[1]], None)
        if i:
            times.append((time.perf_counter() - t) * 1e3)
    res.append(f"{rows}:{statistics.median(times):.2f}/{min(times):.2f}")
print(os.path.dirname(heteroserve.__file__), " ".join(res), flush=True)

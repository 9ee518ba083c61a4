"""All of SmolLM2's layer products at 64 rows (a scenario B decode step without the LM head) on our bfloat16 GEMM,
with the kernels' pool at 1 and at 2 threads, and with the weights streamed from memory (30 layers) against kept
hot in the caches (one layer 30 times), alternating rounds in one process. Run alone:
`python bench/results/vllm_same_run/products_scaling.py 1` (or 2: the pool's threads; torch gets one)."""

import statistics
import sys
import time

import torch

from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.packed import CpuPackedWeight

assert cpu_kernels.load_library()
torch.ops.heteroserve.set_kernel_threads(int(sys.argv[1]), 200)
torch.set_num_threads(1)  # as the engine does: torch's OpenMP team would spin against the pool
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K): qkv, o, gate_up, down
gen = torch.Generator().manual_seed(0)
layers = [
    [CpuPackedWeight.pack(torch.randn(n, k, generator=gen) * 0.05, torch.bfloat16) for n, k in SHAPES]
    for _ in range(30)
]
sides = {"streamed": layers, "hot": [layers[0]] * 30}
inputs = {k: torch.randn(64, k).to(torch.bfloat16) for k in (576, 1536)}
flop = 30 * sum(2 * 64 * n * k for n, k in SHAPES)


def run(weights) -> None:
    for layer in weights:
        for w, (_, k) in zip(layer, SHAPES, strict=True):
            w.matmul(inputs[k], None)


for weights in sides.values():
    run(weights)
rates = {name: [] for name in sides}
for _ in range(7):
    for name, weights in sides.items():
        start = time.perf_counter()
        run(weights)
        rates[name].append(flop / (time.perf_counter() - start) / 1e9)
for name, values in rates.items():
    print(f"{sys.argv[1]} thread(s), {name}: {statistics.median(values):.0f} GFLOP/s ({[round(v) for v in values]})")

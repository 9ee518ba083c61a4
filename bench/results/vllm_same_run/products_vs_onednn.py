"""All of SmolLM2's products (30 layers' q/k/v, o, gate/up, down, then the LM head) on our packed GEMM (the
kernels' pool, torch at one thread) against oneDNN's packed layout (torch's team, the pool at one thread),
alternating rounds in one process. Random weights of SmolLM2's shapes; run alone:
`python bench/results/vllm_same_run/products_vs_onednn.py bfloat16|float32`."""

import statistics
import sys
import time

import torch

from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.packed import CpuPackedWeight
from heteroserve.platforms.cpu.platform import process_threads

DTYPE = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K): qkv, o, gate_up, down
THREADS = process_threads()
assert cpu_kernels.load_library()
gen = torch.Generator().manual_seed(0)
layers = [[(torch.randn(n, k, generator=gen) * 0.05).to(DTYPE) for n, k in SHAPES] for _ in range(30)]
head = (torch.randn(49152, 576, generator=gen) * 0.05).to(DTYPE)
ours = [[CpuPackedWeight.pack(w, DTYPE) for w in layer] for layer in layers], CpuPackedWeight.pack(head, DTYPE)
onednn = (
    [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in layer] for layer in layers],
    torch.ops.mkldnn._reorder_linear_weight(head, 64),
)


def run(kind: str, rows: int, head_rows: int) -> float:
    """ms for one pass over every product (the mean of 3 passes up to 64 rows, 1 beyond)."""
    xs = {k: torch.randn(rows, k, generator=gen).to(DTYPE) for _, k in SHAPES}
    head_x = torch.randn(head_rows, 576, generator=gen).to(DTYPE)
    weights, head_weight = ours if kind == "ours" else onednn
    torch.ops.heteroserve.set_kernel_threads(THREADS if kind == "ours" else 1, 200)
    torch.set_num_threads(1 if kind == "ours" else THREADS)
    if kind == "ours":
        product = lambda x, w: w.matmul(x, None)  # noqa: E731
    else:
        product = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    for layer in weights[:3]:  # warm-up
        for (_, k), w in zip(SHAPES, layer, strict=True):
            product(xs[k], w)
    passes = 3 if rows <= 64 else 1
    start = time.perf_counter()
    for _ in range(passes):
        for layer in weights:
            for (_, k), w in zip(SHAPES, layer, strict=True):
                product(xs[k], w)
        product(head_x, head_weight)
    return (time.perf_counter() - start) / passes * 1000


for rows, head_rows in [(1, 1), (16, 16), (64, 64), (512, 16), (2048, 16)]:
    times: dict[str, list[float]] = {"ours": [], "onednn": []}
    for index in range(3):
        for kind in ("ours", "onednn") if index % 2 == 0 else ("onednn", "ours"):
            times[kind].append(run(kind, rows, head_rows))
    mine, theirs = statistics.median(times["ours"]), statistics.median(times["onednn"])
    print(
        f"{DTYPE} rows={rows:5d}: ours {mine:8.2f} ms, oneDNN {theirs:8.2f} ms, oneDNN / ours {theirs / mine:.2f} "
        f"(rounds {[round(t, 1) for t in times['ours']]} / {[round(t, 1) for t in times['onednn']]})"
    )

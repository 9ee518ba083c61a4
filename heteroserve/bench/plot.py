"""PNG charts of a benchmark result: throughput bars per engine, latency distributions."""

from __future__ import annotations

from pathlib import Path


def plot_result(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    bars = {"heteroserve": _throughput(result.get("heteroserve", {}))}
    if "offline" in result:
        bars["heteroserve offline"] = _throughput(result["offline"])
    for name, peer in result.get("peers", {}).items():
        bars[name] = _throughput(peer)
    names = [n for n, v in bars.items() if v is not None]
    axes[0].bar(names, [bars[n] for n in names], color=["#2563eb"] + ["#9ca3af"] * (len(names) - 1))
    axes[0].set_ylabel("output tokens/s" if result["command"] != "latency" else "decode tokens/s")
    axes[0].set_title(f"{result['command']}: throughput")
    axes[0].tick_params(axis="x", rotation=20)
    samples = result.get("latency_samples_ms", {})
    for label, values in samples.items():
        ordered = sorted(values)
        if ordered:
            axes[1].plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
    axes[1].set_xlabel("ms")
    axes[1].set_ylabel("fraction of requests / tokens")
    axes[1].set_title("latency CDF")
    if samples:
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _throughput(entry: dict) -> float | None:
    for key in ("output_tokens_per_s", "decode_tokens_per_s"):
        if key in entry:
            return float(entry[key])
    return None

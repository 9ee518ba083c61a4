"""`heteroserve bench threads`: scenario A under each OpenMP wait policy, and beside a second engine.

The engine's C++ kernels run on a thread pool of their own (platforms/cpu/csrc/thread_pool.h), so OpenMP's variables
should not move its speed; and an idle or waiting engine should leave the cores to a neighbour (the test suite
runs a server beside the test process; two OpenMP processes that spin on 2 cores slow each other many times
over). Each setting is a fresh `heteroserve bench latency` process, the settings alternate over the rounds (this
machine's pace drifts from minute to minute), and the report gives each setting's median decode rate against the
best.
"Beside a neighbour" starts two such processes together and reports each one's rate against the same round's
rate alone: two engines that share 2 cores fairly each run at about half speed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from heteroserve.entrypoints.env_report import collect_env

# Name -> the environment variables set (None: removed) for the engine's process.
SETTINGS: dict[str, dict[str, str | None]] = {
    "OMP_WAIT_POLICY unset": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None},
    "OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None},
}
ALONE = "OMP_WAIT_POLICY unset"
NEIGHBOUR = "beside a neighbour (two engines at once)"


def _environment(setting: dict[str, str | None]) -> dict[str, str]:
    env = dict(os.environ)
    for name, value in setting.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _latency_command(args, output: Path) -> list[str]:
    extra = [a for a in args.latency_args if a != "--"]
    return [
        sys.executable,
        "-m",
        "heteroserve.entrypoints.cli",
        "bench",
        "latency",
        *extra,
        "--repeats",
        str(args.repeats),
        "--output-len",
        str(args.output_len),
        "--output-json",
        str(output),
    ]


def _run_together(args, settings: list[dict[str, str | None]], folder: Path) -> list[dict]:
    """One `bench latency` process per setting, all started at once; each one's result."""
    outputs = [folder / f"run{index}.json" for index in range(len(settings))]
    processes = [
        subprocess.Popen(
            _latency_command(args, output),
            env=_environment(setting),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for setting, output in zip(settings, outputs, strict=True)
    ]
    for process in processes:
        _, stderr = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"bench latency failed:\n{stderr[-3000:]}")
    results = []
    for output in outputs:
        report = json.loads(output.read_text())["heteroserve"]
        results.append({"decode_tokens_per_s": report["decode_tokens_per_s"], "prefill_ms": report["prefill_ms"]})
    return results


def run_threads_bench(args) -> None:
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    rounds: dict[str, list[dict]] = {name: [] for name in [*SETTINGS, NEIGHBOUR]}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for index in range(args.rounds):
            for name, setting in SETTINGS.items():
                result = _run_together(args, [setting], folder)[0]
                rounds[name].append(result)
                print(f"round {index + 1}: {name}: decode {result['decode_tokens_per_s']:.1f} tok/s", flush=True)
            pair = _run_together(args, [SETTINGS[ALONE], SETTINGS[ALONE]], folder)
            rounds[NEIGHBOUR].append({"decode_tokens_per_s": [r["decode_tokens_per_s"] for r in pair]})
            alone = rounds[ALONE][-1]["decode_tokens_per_s"]
            rates = [r["decode_tokens_per_s"] for r in pair]
            print(
                f"round {index + 1}: {NEIGHBOUR}: decode {', '.join(f'{rate:.1f}' for rate in rates)} tok/s "
                f"({', '.join(f'{alone / rate:.2f}x' for rate in rates)} slower than alone)",
                flush=True,
            )
    medians = {name: statistics.median(r["decode_tokens_per_s"] for r in rounds[name]) for name in SETTINGS}
    best = max(medians.values())
    slowdowns = [
        alone["decode_tokens_per_s"] / rate
        for alone, pair in zip(rounds[ALONE], rounds[NEIGHBOUR], strict=True)
        for rate in pair["decode_tokens_per_s"]
    ]
    result = {
        "command": "threads",
        "latency_args": [a for a in args.latency_args if a != "--"],
        "rounds": rounds,
        "median_decode_tokens_per_s": medians,
        "ratio_to_best": {name: rate / best for name, rate in medians.items()},
        "neighbour_slowdown": {"each": slowdowns, "median": statistics.median(slowdowns)},
        "machine": {key: value for key, value in collect_env("auto").items() if key in ("cpu", "chosen", "torch")},
    }
    for name, rate in medians.items():
        print(f"{name}: median decode {rate:.1f} tok/s ({rate / best:.2f}x the best)")
    print(f"{NEIGHBOUR}: each engine {result['neighbour_slowdown']['median']:.2f}x slower than alone (median)")
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output_json}")

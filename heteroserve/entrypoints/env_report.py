"""`heteroserve env`: what this machine offers heteroserve, for bug reports and for checking a vendor stack.

Lists every platform (built-in and plugin, available or not), the one `--device` selects, versions of
torch and the vendor extensions, the CPU's instruction sets, memory, and the kernel each operator runs.
Loading torch and the platforms takes seconds, so the versions that need neither are printed first.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform as pyplatform

GIB = 1024**3


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_report() -> dict[str, object]:
    """The fields that need neither torch nor the platforms."""
    return {
        "heteroserve": _version("heteroserve"),
        "python": pyplatform.python_version(),
        "os": pyplatform.platform(),
    }


def collect_env(device: str = "auto") -> dict[str, object]:
    import torch

    from heteroserve.platforms import BUILTIN_PLATFORMS, detect_platforms, resolve_platform
    from heteroserve.platforms.cpu.platform import cpu_isa_flags, host_memory, isa_names

    entries = detect_platforms()
    extensions = {cls.vendor_extension: None for cls in BUILTIN_PLATFORMS.values() if cls.vendor_extension}
    extensions.update({e.source.removeprefix("plugin "): None for e in entries if e.source.startswith("plugin ")})
    available, total = host_memory()
    report: dict[str, object] = {
        **host_report(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
        "extensions": {name: _version(name) for name in extensions},
        "cpu": {
            "machine": pyplatform.machine(),
            "isa": isa_names(cpu_isa_flags()),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
        },
        "host_memory_gib": {"available": round(available / GIB, 1), "total": round(total / GIB, 1)},
        "platforms": [{"name": e.name, "source": e.source, "available": e.available, "note": e.note} for e in entries],
    }
    try:
        chosen = resolve_platform(device)
    except ValueError as exc:
        report["chosen"] = {"error": str(exc)}
        return report
    chosen.configure_process()  # the thread settings an engine's process would run with
    dtype = chosen.default_dtype()
    try:
        free, device_total = chosen.memory_info()
        memory: object = {"free": round(free / GIB, 1), "total": round(device_total / GIB, 1)}
    except Exception as exc:  # a plugin's device may not report memory; the report still helps
        memory = f"unknown ({type(exc).__name__}: {exc})"
    report["chosen"] = {
        **chosen.describe(),
        "dtypes": [str(d).removeprefix("torch.") for d in chosen.supported_dtypes()],
        "default_dtype": str(dtype).removeprefix("torch."),
        "memory_gib": memory,
        "operators": chosen.operator_table(dtype).describe(),
    }
    return report


def format_host(report: dict[str, object]) -> str:
    return "\n".join(f"{key + ':':<16}{report[key]}" for key in host_report())


def format_machine(report: dict[str, object]) -> str:
    """Everything after format_host's lines."""
    lines = [f"{key + ':':<16}{report[key]}" for key in ("torch", "torch_cuda", "torch_hip")]
    for name, version in report["extensions"].items():
        lines.append(f"{name + ':':<16}{version or 'not installed'}")
    cpu = report["cpu"]
    lines.append(f"{'cpu:':<16}{cpu['machine']}, ISA {' '.join(cpu['isa']) or 'baseline'}, ")
    lines[-1] += f"torch kernels {cpu['torch_cpu_capability']}, {cpu['threads']} threads"
    mem = report["host_memory_gib"]
    lines.append(f"{'host memory:':<16}{mem['available']} GiB available of {mem['total']} GiB")
    lines.append("")
    lines.append("platforms (in the order device=auto tries them):")
    for p in report["platforms"]:
        state = "available" if p["available"] else "unavailable"
        note = f" ({p['note']})" if p["note"] else ""
        lines.append(f"  {p['name']:<10} {p['source']:<40} {state}{note}")
    lines.append("")
    chosen = dict(report["chosen"])
    if "error" in chosen:
        lines.append(f"chosen: none: {chosen['error']}")
        return "\n".join(lines)
    operators = chosen.pop("operators")
    lines.append(f"chosen: {chosen.pop('platform')}")
    memory = chosen.pop("memory_gib")
    if isinstance(memory, dict):
        memory = f"{memory['free']} GiB free of {memory['total']} GiB"
    chosen["memory"] = memory
    for key, value in chosen.items():
        lines.append(f"  {key + ':':<22}{', '.join(value) if isinstance(value, list) else value}")
    lines.append("  operators:")
    for name, kernel in operators.items():
        lines.append(f"    {name:<25}{kernel}")
    return "\n".join(lines)


def print_env(device: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(collect_env(device), indent=2))
        return
    print(format_host(host_report()), flush=True)  # at once, before the seconds collect_env takes
    print(format_machine(collect_env(device)))

"""Third-party platforms: discovered through entry points, selected by name, used for a generation.

The example plugin (example_plugin/) is installed into a temporary folder the way pip would leave it,
and a fresh interpreter with that folder on its path does the work, so discovery is the real one."""

from __future__ import annotations

import json

from tests.platforms.plugin_site import last_json, run_python

SCRIPT = """
import json, sys
import heteroserve_counting_platform as plugin
from prometheus_client import generate_latest
from heteroserve import LLM, SamplingParams
from heteroserve.metrics.prometheus import ServerMetrics
from heteroserve.platforms import detect_platforms, resolve_platform

folder, prompts = sys.argv[1], json.loads(sys.argv[2])
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
report = {"platforms": {e.name: [e.source, e.available] for e in detect_platforms()}}
report["auto"] = type(resolve_platform("auto")).__name__
try:
    resolve_platform("absent")
except ValueError as exc:
    report["absent_error"] = str(exc)
for device in ("cpu", "counting", "partial", "flaky", "contiguous"):
    plugin.KERNEL_CALLS.clear()
    llm = LLM(model=folder, device=device, dtype="float32", max_model_len=128, num_kv_blocks=64)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    metrics = generate_latest(ServerMetrics(llm.engine, "tiny").registry).decode()
    report[device] = {
        "platform": type(llm.engine.platform).__name__,
        "attention": llm.engine.executor.worker.runner.attn_backend.name,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "kernel_calls": dict(plugin.KERNEL_CALLS),
        "fallbacks": dict(llm.engine.platform.operator_fallbacks),
        "metric_lines": [line for line in metrics.splitlines() if line.startswith("heteroserve:operator_fallbacks")],
    }
print(json.dumps(report))
"""


def test_plugin_platforms_generate_like_the_cpu(plugin_site, tiny_qwen3):
    prompts = [[5, 17, 33, 2, 9, 100, 41, 7, 250, 3, 66, 12], [8, 8, 19]]
    result = run_python(["-c", SCRIPT, str(tiny_qwen3.folder), json.dumps(prompts)], plugin_site)
    report = last_json(result)

    # Discovery: plugins first (so `auto` picks the first available one), built-ins after, the CPU last.
    names = list(report["platforms"])
    assert names[:5] == ["counting", "partial", "flaky", "contiguous", "absent"] and names[-1] == "cpu"
    assert report["platforms"]["counting"] == ["plugin heteroserve-counting-platform", True]
    assert report["platforms"]["absent"][1] is False
    assert report["auto"] == "CountingPlatform"
    assert "'absent' is not available here (the plugin reports no device here)" in report["absent_error"]
    assert "available: counting, partial, flaky, contiguous, cpu" in report["absent_error"]

    cpu = report["cpu"]
    assert cpu["platform"] == "CpuPlatform" and cpu["kernel_calls"] == {} and cpu["fallbacks"] == {}
    for device in ("counting", "partial", "flaky", "contiguous"):
        assert report[device]["tokens"] == cpu["tokens"], device
        assert report[device]["attention"] == ("contiguous" if device == "contiguous" else "paged"), device

    counting = report["counting"]
    assert counting["platform"] == "CountingPlatform" and counting["fallbacks"] == {}
    assert set(counting["kernel_calls"]) == {
        "rms_norm",
        "rotary",
        "silu_and_mul",
        "write_kv",
        "prefill_attention",
        "decode_attention",
        "argmax_rows",
    }
    # 3 layers x (2 layer norms + q and k norms) + the final norm, once per step.
    assert counting["kernel_calls"]["rms_norm"] % 13 == 0

    # The plugin's own attention backend ran every layer of every step; the paged operators never ran.
    contiguous = report["contiguous"]
    assert contiguous["platform"] == "ContiguousPlatform" and contiguous["fallbacks"] == {}
    calls = contiguous["kernel_calls"]
    assert not {"write_kv", "prefill_attention", "decode_attention"} & set(calls)
    assert calls["attention.build_metadata"] > 0
    assert calls["attention.forward"] == 3 * calls["attention.build_metadata"]  # 3 layers
    assert "attention.forward" not in counting["kernel_calls"]

    partial = report["partial"]
    assert set(partial["fallbacks"]) == {"rms_norm", "decode_attention"}
    assert partial["fallbacks"]["rms_norm"] == counting["kernel_calls"]["rms_norm"]
    assert partial["fallbacks"]["decode_attention"] == counting["kernel_calls"]["decode_attention"]
    assert "rms_norm" not in partial["kernel_calls"] and partial["kernel_calls"]["rotary"] > 0

    flaky = report["flaky"]
    assert set(flaky["fallbacks"]) == {"silu_and_mul", "prefill_attention"}
    # The kernel was tried on every call and each attempt fell back.
    assert flaky["fallbacks"]["silu_and_mul"] == flaky["kernel_calls"]["silu_and_mul"] > 0
    assert flaky["fallbacks"]["prefill_attention"] == flaky["kernel_calls"]["prefill_attention"] > 0

    # One warning per operator and engine, however many calls fell back.
    for operator in ("rms_norm", "decode_attention", "silu_and_mul", "prefill_attention"):
        assert result.stderr.count(f"operator {operator} runs on the CPU") == 1, operator

    # The counts reach Prometheus, with a zero series for every operator that never fell back.
    lines = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in flaky["metric_lines"]}
    silu = 'model_name="tiny",operator="silu_and_mul"'
    assert lines[silu] == flaky["fallbacks"]["silu_and_mul"]
    assert lines['model_name="tiny",operator="rotary"'] == 0
    assert all(value == 0 for value in (float(line.rsplit(" ", 1)[1]) for line in cpu["metric_lines"]))


def test_environment_variable_selects_a_plugin(plugin_site):
    code = "from heteroserve.platforms import resolve_platform; print(type(resolve_platform()).__name__)"
    result = run_python(["-c", code], plugin_site, {"HETEROSERVE_DEVICE": "partial"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "PartialPlatform"


DEFAULT_MODEL_SCRIPT = """
import json, sys
import heteroserve_counting_platform as plugin
from heteroserve import LLM, SamplingParams

prompts = json.loads(sys.argv[1])
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
report = {}
for device in ("cpu", "contiguous"):
    plugin.KERNEL_CALLS.clear()
    llm = LLM(device=device, max_model_len=128, kv_cache_memory_bytes=32 * 1024**2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    layer = llm.engine.executor.worker.runner.model.layers[0]
    report[device] = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "int4_calls": plugin.KERNEL_CALLS["linear.int4"],
        "attention_calls": plugin.KERNEL_CALLS["attention.forward"],
        "down_proj": type(layer.down_proj).__name__,
        "layer_cache_shape": list(llm.engine.executor.worker.runner.layer_caches[0][0].shape[1:]),
        "runner": type(llm.engine.executor.worker.runner).__name__,
        "runner_steps": plugin.KERNEL_CALLS["runner.execute"],
    }
print(json.dumps(report))
"""


def test_plugin_weight_kernel_runs_the_default_model(plugin_site, default_model_path):
    """The example plugin's own attention backend (its own KV cache layout), 4-bit kernel and model runner give
    the default model's (Q4_1) greedy tokens, with heteroserve's code untouched: the kernel is registered with the
    linear op from the plugin, the runner named by the platform."""
    prompts = ["The capital of France is", "def quicksort(arr):\n"]
    report = last_json(run_python(["-c", DEFAULT_MODEL_SCRIPT, json.dumps(prompts)], plugin_site))
    cpu, plugin = report["cpu"], report["contiguous"]
    assert plugin["tokens"] == cpu["tokens"]
    assert cpu["int4_calls"] == 0 and plugin["down_proj"] == "ExampleInt4Weight"
    assert plugin["int4_calls"] > 0 and plugin["attention_calls"] > 0
    assert (cpu["runner"], plugin["runner"]) == ("ModelRunner", "CountingModelRunner") and plugin["runner_steps"] > 0
    # [block_size, heads, head_dim] on the CPU; the plugin's backend lays its cache out heads first
    assert plugin["layer_cache_shape"] == [cpu["layer_cache_shape"][1], cpu["layer_cache_shape"][0], 64]

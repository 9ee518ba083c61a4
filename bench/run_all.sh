#!/usr/bin/env bash
# Runs the benchmarks of ../shared/bench/WORKLOAD.md serially (nothing else should run meanwhile) and
# writes bench/results/. Takes about 10 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
mkdir -p bench/results
heteroserve bench latency --peer hf --output-json bench/results/scenario_a.json --plot bench/results/scenario_a.png
heteroserve bench throughput --scenario B --peer hf --hf-batch 1,8,64 --hf-requests 2 \
    --output-json bench/results/scenario_b.json --plot bench/results/scenario_b.png
heteroserve bench serve --concurrency 16 --num-requests 16 --input-len 128 --output-len 64 \
    --output-json bench/results/scenario_c.json --plot bench/results/scenario_c.png

#!/usr/bin/env bash
# Runs the benchmarks of ../shared/bench/WORKLOAD.md serially (nothing else should run meanwhile) and
# writes bench/results/. Float32 (the default model dequantised: --quantization none) against transformers,
# then the default model as shipped (4-bit). Takes about 15 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
mkdir -p bench/results
heteroserve bench latency --quantization none --peer hf \
    --output-json bench/results/scenario_a.json --plot bench/results/scenario_a.png
heteroserve bench throughput --quantization none --scenario B --peer hf --hf-batch 1,8,64 --hf-requests 2 \
    --output-json bench/results/scenario_b.json --plot bench/results/scenario_b.png
heteroserve bench throughput --quantization none --scenario D --peer hf --hf-batch 8 \
    --output-json bench/results/scenario_d.json --plot bench/results/scenario_d.png
heteroserve bench serve --quantization none --concurrency 16 --num-requests 16 --input-len 128 --output-len 64 \
    --output-json bench/results/scenario_c.json --plot bench/results/scenario_c.png
heteroserve bench latency --output-json bench/results/scenario_a_q4.json
heteroserve bench throughput --scenario B --output-json bench/results/scenario_b_q4.json
heteroserve bench throughput --quantization none --kernels reference --scenario B \
    --output-json bench/results/scenario_b_reference_kernels.json
heteroserve bench serve --quantization none --gateway --no-compare-offline --concurrency 16 --num-requests 16 \
    --input-len 128 --output-len 64 --ttft-requests 20 --output-json bench/results/gateway_overhead.json

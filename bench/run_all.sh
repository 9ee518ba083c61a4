#!/usr/bin/env bash
# Runs the benchmarks of ../shared/bench/WORKLOAD.md serially (nothing else should run meanwhile) and
# writes bench/results/. Float32 (the default model dequantised: --quantization none) against transformers,
# then the default model as shipped (4-bit), then vLLM's CPU build where scripts/setup-vllm-peer.sh installed it.
# Takes about 30-35 minutes on a 2-core machine without vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
mkdir -p bench/results
# A, B and D alternate ours and transformers over rounds (this machine's pace drifts between minutes): each ratio
# is the median of the rounds' adjacent pairs.
heteroserve bench latency --quantization none --peer hf --rounds 3 \
    --output-json bench/results/scenario_a.json --plot bench/results/scenario_a.png
heteroserve bench throughput --quantization none --scenario B --peer hf --hf-batch 1,8,64 --hf-requests 2 --rounds 3 \
    --output-json bench/results/scenario_b.json --plot bench/results/scenario_b.png
heteroserve bench throughput --quantization none --scenario D --peer hf --hf-batch 8 --rounds 2 \
    --output-json bench/results/scenario_d.json --plot bench/results/scenario_d.png
# Float32 weights and activations over a float16 KV cache (--kv-cache-dtype; llama.cpp's default cache type): B beside
# transformers' one static batch of 64 in the same invocation, and D.
heteroserve bench throughput --quantization none --kv-cache-dtype float16 --scenario B --peer hf --hf-batch 64 \
    --output-json bench/results/scenario_b_kv16.json
heteroserve bench throughput --quantization none --kv-cache-dtype float16 --scenario D \
    --output-json bench/results/scenario_d_kv16.json
# Speculative decoding by n-gram lookup (--speculative-config; the greedy outputs are plain decoding's, checked
# against transformers' below): A and B beside transformers in the same invocation.
NGRAM='{"method": "ngram", "num_speculative_tokens": 4}'
heteroserve bench latency --quantization none --speculative-config "$NGRAM" --peer hf \
    --output-json bench/results/scenario_a_ngram.json
heteroserve bench throughput --quantization none --speculative-config "$NGRAM" --scenario B --peer hf --hf-batch 64 \
    --output-json bench/results/scenario_b_ngram.json
# The server against the offline engine: 16 concurrent requests on each side over 3 alternating rounds, then the
# concurrency-1 TTFT comparison, 40 pairs over 4 fresh server/engine processes.
heteroserve bench serve --quantization none --concurrency 16 --num-requests 16 --input-len 128 --output-len 64 \
    --rounds 3 --ttft-requests 40 --ttft-rounds 4 --output-json bench/results/scenario_c.json --plot bench/results/scenario_c.png
# As shipped (4-bit), beside llama.cpp on the same Q4_1 file when llama-cpp-python is installed (the [llama-cpp]
# extra; without it the peer is recorded as skipped); then A with both on the file dequantised to float32
# (llama.cpp on an F32 copy, heteroserve/bench/peers/gguf_float.py).
heteroserve bench latency --peer llama-cpp --rounds 5 --output-json bench/results/scenario_a_q4.json
heteroserve bench latency --quantization none --peer llama-cpp --rounds 5 \
    --output-json bench/results/scenario_a_llama_cpp_f32.json
heteroserve bench throughput --scenario B --peer llama-cpp --hf-requests 2 --output-json bench/results/scenario_b_q4.json
heteroserve bench throughput --quantization none --kernels reference --scenario B \
    --output-json bench/results/scenario_b_reference_kernels.json
heteroserve bench serve --quantization none --gateway --no-compare-offline --concurrency 16 --num-requests 16 \
    --input-len 128 --output-len 64 --rounds 3 --ttft-requests 40 --output-json bench/results/gateway_overhead.json
# Vision-language: the tests' tiny random Qwen2-VL, one 448x448 image, against transformers.
VL_DIR=$(mktemp -d)
python -c "import sys; from pathlib import Path; from tests.model.tiny_vl import save_tiny_vl; save_tiny_vl('qwen2_vl', Path(sys.argv[1]))" "$VL_DIR"
heteroserve bench vision "$VL_DIR/qwen2_vl" --dtype float32 --max-model-len 512 --output-json bench/results/vision_qwen2_vl.json
rm -rf "$VL_DIR"
# vLLM's CPU build (../shared/bench/peers.md's set-up) on the same float32 weights, when scripts/setup-vllm-peer.sh
# has made .venv-vllm: B and D through `LLM.generate`, C against its OpenAI server, alternating rounds with ours.
if [ -x "${HETEROSERVE_VLLM_VENV:-.venv-vllm}/bin/python" ]; then
    heteroserve bench throughput --quantization none --scenario B --peer vllm --rounds 3 \
        --output-json bench/results/scenario_b_vllm.json
    heteroserve bench throughput --quantization none --scenario D --peer vllm --rounds 2 \
        --output-json bench/results/scenario_d_vllm.json
    heteroserve bench serve --quantization none --peer vllm --no-compare-offline --no-enable-prefix-caching \
        --concurrency 16 --num-requests 16 --input-len 128 --output-len 64 --rounds 3 \
        --output-json bench/results/scenario_c_vllm.json
fi

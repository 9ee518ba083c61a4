#!/usr/bin/env bash
# Sets everything up, then serves the embedded default model: chat page and OpenAI API on port 8000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec heteroserve serve "$@"

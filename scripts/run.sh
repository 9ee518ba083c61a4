#!/usr/bin/env bash
# Sets everything up, then runs the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec heteroserve chat "$@"

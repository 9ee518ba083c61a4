#!/usr/bin/env bash
# Sets everything up, then runs the test suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Lint and formatting first: a change ruff refuses fails the run before the suite's ~15 minutes.
ruff check .
ruff format --check heteroserve tests scripts
# The test process and the servers it starts share 2 cores: no OpenMP spin-waiting.
export OMP_WAIT_POLICY=PASSIVE
exec python -m pytest "$@"

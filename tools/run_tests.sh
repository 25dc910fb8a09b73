#!/usr/bin/env bash
# Sets up .venv if needed and runs the test suite: bash tools/run_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_env.sh
exec python -m pytest -q tests "$@"

#!/usr/bin/env bash
# Creates .venv and installs the pinned CPU dependencies and this package into it.
# Sourced by the quickstart and the test runner; does nothing when already up to date.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.megatron-dilocox-installed"
WANT="$(cat "$ROOT/requirements-cpu.txt" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "> creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "> installing pinned dependencies (torch CPU build, megatron-core, ...) into $VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # torch first, pinned, so nothing pulls a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install --quiet -r "$ROOT/requirements-cpu.txt"
  "$VENV/bin/python" -m pip install --quiet --no-deps -e "$ROOT"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"

#!/usr/bin/env bash
# Creates .venv, installs the pinned CPU dependencies (requirements-cpu.txt, every other package at
# its version in constraints-cpu.txt) and this package into it, and puts it first on
# PATH: `source tools/setup_env.sh`. Does nothing when already up to date.
# The install runs in a subshell under `set -euo pipefail`, so the caller's shell options and
# variables stay as they were; a failed install makes `source` return non-zero, which stops a
# caller running under `set -e` (the quickstart, the test runner).
_setup_env_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_setup_env_venv="${VENV:-$_setup_env_root/.venv}"
# A relative VENV (VENV=.venv-py312) is taken from the caller's directory and made absolute, so
# that PATH (and sys.executable in what runs from it) does not depend on the directory later.
case "$_setup_env_venv" in /*) ;; *) _setup_env_venv="$PWD/$_setup_env_venv" ;; esac
(
  set -euo pipefail
  ROOT=$_setup_env_root
  VENV=$_setup_env_venv
  PYTHON="${PYTHON:-python3}"
  STAMP="$VENV/.megatron-dilocox-installed"
  WANT="$(cat "$ROOT/requirements-cpu.txt" "$ROOT/constraints-cpu.txt" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "> creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "> installing pinned dependencies (torch CPU build, megatron-core, ...) into $VENV"
    "$VENV/bin/python" -m pip install --quiet -c "$ROOT/constraints-cpu.txt" pip
    # torch first, pinned, so nothing pulls a multi-GB CUDA build.
    "$VENV/bin/python" -m pip install --quiet -r "$ROOT/requirements-cpu.txt" -c "$ROOT/constraints-cpu.txt"
    "$VENV/bin/python" -m pip install --quiet --no-deps -e "$ROOT"
    echo "$WANT" > "$STAMP"
  fi
)
# Not `( ... ) || status=$?`: a tested subshell would run with `set -e` ignored.
_setup_env_status=$?
if [ "$_setup_env_status" -eq 0 ]; then
  export PATH="$_setup_env_venv/bin:$PATH"
else
  echo "tools/setup_env.sh: error: installing into $_setup_env_venv failed (see above)" >&2
fi
unset _setup_env_root _setup_env_venv
# Sourced: return, run with bash: exit; the status is expanded before the unset runs.
eval "unset _setup_env_status; return $_setup_env_status 2>/dev/null || exit $_setup_env_status"

#!/usr/bin/env bash
# The CUDA path on one GPU in one prepared run (tools/gpu_check.py says what it measures).
#
#   bash tools/gpu_check.sh --prepare     # once, where PyPI is reachable: into gpu_wheels/, the wheels
#                                         # a CUDA PyTorch image lacks (megatron-core, torchft and what
#                                         # it imports), for Python 3.12 (PYTHON_VERSION=3.11 for another)
#   bash tools/gpu_check.sh [FLAGS]       # on the GPU machine, offline: the wheels installed beside the
#                                         # image's packages (torch with CUDA), then
#                                         # python tools/gpu_check.py [FLAGS] (--help lists them)
#
# PYTHON names the interpreter that holds the image's torch (default python3), WHEELS the wheels'
# folder (default gpu_wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-gpu_wheels}
case "${1:-}" in
  --prepare) exec "$PY" tools/gpu_check.py --prepare --wheels "$WHEELS" --python-version "${PYTHON_VERSION:-3.12}" ;;
  -h|--help) sed -n '2,12p' "$0" | cut -c3-; exec "$PY" tools/gpu_check.py --help ;;
esac
if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "gpu_check.sh: error: no wheels in $WHEELS/: run 'bash tools/gpu_check.sh --prepare' where PyPI is reachable" \
       "and bring $WHEELS/ along (megatron-core, torchft and its OpenTelemetry packages, protobuf)" >&2
  exit 2
fi
# The image's Python may itself be a virtual environment (a venv made from it would not see its
# torch), so the wheels go into a folder of their own, ahead of its packages on PYTHONPATH.
SITE=${SITE:-/tmp/gpu_check_site}
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check --upgrade \
  --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" tools/gpu_check.py "$@"

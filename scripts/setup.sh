#!/usr/bin/env bash
# Create .venv with lorafleet and everything it needs, and generate the tiny model.
# Idempotent and quiet on re-runs. Prints nothing but errors unless VERBOSE=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.lorafleet-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  # torch first and pinned: anything unpinned would pull a multi-GB CUDA build.
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[engine,dev,bench,front-test,ray]"
  touch "$stamp"
fi
# The tiny model is generated (never downloaded) into a content-keyed cache.
.venv/bin/lorafleet tiny-model --cached >/dev/null

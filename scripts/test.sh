#!/usr/bin/env bash
# The whole test suite, from a fresh clone: venv, dependencies, tiny model, the real-vLLM tier,
# lint, then pytest. Extra arguments go to pytest (e.g. scripts/test.sh tests/bundle -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "${LORAFLEET_SKIP_VLLM:-0}" != "1" ]; then
  LORAFLEET_VLLM_VENV="$(scripts/setup-vllm.sh | tail -n 1)"
  export LORAFLEET_VLLM_VENV
fi
.venv/bin/ruff check src tests bench examples
.venv/bin/ruff format --check src tests bench examples
exec .venv/bin/pytest -q -p no:cacheprovider "$@"

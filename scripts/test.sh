#!/usr/bin/env bash
# The whole test suite, from a fresh clone: venv, dependencies, tiny model, the real-vLLM and
# real-SGLang tiers, the SkyRL and AReaL client tiers, lint, then pytest. Extra arguments go to
# pytest (e.g. scripts/test.sh tests/bundle -x). LORAFLEET_SKIP_VLLM=1 / LORAFLEET_SKIP_SGLANG=1 /
# LORAFLEET_SKIP_SKYRL=1 / LORAFLEET_SKIP_AREAL=1 skip a tier and its install.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "${LORAFLEET_SKIP_VLLM:-0}" != "1" ]; then
  LORAFLEET_VLLM_VENV="$(scripts/setup-vllm.sh | tail -n 1)"
  export LORAFLEET_VLLM_VENV
fi
if [ "${LORAFLEET_SKIP_SGLANG:-0}" != "1" ]; then
  # sglang 0.5.23 on CPU, cached; ~3.5 CPU-minutes the first time (docs/engines/sglang.md).
  LORAFLEET_SGLANG_VENV="$(scripts/setup-sglang.sh | tail -n 1)"
  export LORAFLEET_SGLANG_VENV
fi
if [ "${LORAFLEET_SKIP_SKYRL:-0}" != "1" ]; then
  # SkyRL 0.4.0 (its inference client and its Tinker server's ExternalInferenceClient) in its
  # own Python 3.12 venv, cached (tests/front/test_skyrl*.py, tests/router/test_skyrl_tinker.py).
  LORAFLEET_SKYRL_VENV="$(scripts/setup-skyrl.sh | tail -n 1)"
  export LORAFLEET_SKYRL_VENV
fi
if [ "${LORAFLEET_SKIP_AREAL:-0}" != "1" ]; then
  # AReaL 1.0.4's client side (its RemoteSGLangEngine / RemotevLLMEngine), cached; ~3.5 min once.
  LORAFLEET_AREAL_VENV="$(scripts/setup-areal.sh | tail -n 1)"
  export LORAFLEET_AREAL_VENV
fi
.venv/bin/ruff check src tests bench examples
.venv/bin/ruff format --check src tests bench examples
# Two workers: most of the suite waits on servers, not on the CPU (about one core busy on
# average when run serially). tests/conftest.py keeps each module on one worker and every test
# that needs a real vLLM/SGLang server or a Ray cluster on the same one, run first.
# LORAFLEET_TEST_WORKERS=0 runs it serially.
exec .venv/bin/pytest -q -p no:cacheprovider -n "${LORAFLEET_TEST_WORKERS:-2}" --dist loadgroup \
  --no-loadscope-reorder "$@"

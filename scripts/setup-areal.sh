#!/usr/bin/env bash
# Install the AReaL client tier (areal 1.0.4, its RemoteSGLangEngine / RemotevLLMEngine) into its
# own cached venv. Only AReaL's client side is needed: the engines it would drive are lorafleet's
# front. areal's wheel pins CUDA training stacks, so it goes in without its dependencies, followed
# by what its modules need at import time (../shared/research/trainer-clients.md). ~3.5 min.
# Idempotent: a finished venv is reused. The last line printed is the venv path; the rest is stderr.
set -euo pipefail
AREAL_VERSION=1.0.4
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/_venv.sh
. "$HERE/_venv.sh"
VENV="${LORAFLEET_AREAL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/lorafleet/venv-areal-$AREAL_VERSION}"
STAMP="$VENV/.lorafleet-ready"
DEPS=(
  aiohttp httpx requests colorlog tenacity flask torchdata lark uvloop pyyaml "hydra-core==1.4.0.dev1"
  "omegaconf==2.4.0.dev2" "transformers>=5.0.0,<=5.3.0" ray numba pillow orjson einops aiofiles
  openai pybase64
)
# The stamp holds a digest of the recipe, so a changed version or dependency list rebuilds.
RECIPE="$(printf '%s\n' "$AREAL_VERSION" "${DEPS[@]}" | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ]; then
  echo "$VENV"
  exit 0
fi

start=$SECONDS
venv_fresh "$VENV"
venv_torch "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" --no-deps "areal==$AREAL_VERSION" >&2
"${PIP[@]}" -c "$VENV/lorafleet-constraints.txt" "${DEPS[@]}" >&2
venv_check_torch "$VENV"
# The two engine classes the tests drive, imported as a trainer imports them.
"$VENV/bin/python" -c "
import importlib.metadata as md
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.engine.vllm_remote import RemotevLLMEngine
assert md.version('areal') == '$AREAL_VERSION', md.version('areal')
" >&2
echo "$RECIPE" > "$STAMP"
echo "areal $AREAL_VERSION installed in $((SECONDS - start)) s" >&2
echo "$VENV"

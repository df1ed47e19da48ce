#!/usr/bin/env bash
# Install SkyRL 0.4.0's client tier (its own RemoteInferenceClient and its Tinker server's
# ExternalInferenceClient, unmodified) into a cached
# Python 3.12 venv: SkyRL needs Python >= 3.12, lorafleet's venv is 3.11. Only the client's import
# dependencies are installed (--no-deps skyrl): the full set pulls a multi-GB CUDA torch. SkyRL's
# client names torch types in annotations only; tests/front/skyrl_helpers.py supplies a minimal
# import-time stand-in for torch. Idempotent: a finished venv is reused. The last line printed is
# the venv path; everything else goes to stderr.
set -euo pipefail
SKYRL_VERSION=0.4.0
VENV="${LORAFLEET_SKYRL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/lorafleet/venv-skyrl-$SKYRL_VERSION}"
STAMP="$VENV/.lorafleet-ready"
# The Tinker server's ExternalInferenceClient (skyrl.tinker.extra) adds httpx, SQLModel, FastAPI
# and the tinker SDK (its protobuf types); transformers is pinned to SkyRL's own range.
DEPS=(aiohttp orjson numpy pybase64 pydantic cloudpathlib rich loguru
  httpx sqlmodel "sqlalchemy[asyncio]" fastapi psutil zstandard "tinker>=0.25,<0.26"
  "transformers>=5.6.1,<=5.16.1")
# The stamp holds a digest of the recipe, so a changed dependency list rebuilds the venv.
RECIPE="$(printf '%s\n' "$SKYRL_VERSION" "${DEPS[@]}" | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ]; then
  echo "$VENV"
  exit 0
fi
PY="${LORAFLEET_PYTHON312:-$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12)}"
if [ -z "$PY" ]; then
  echo "setup-skyrl: no python3.12 (pyenv 3.12.1 or python3.12 on PATH)" >&2
  exit 1
fi
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV" >&2
"$VENV/bin/pip" install -q --no-deps "skyrl==$SKYRL_VERSION" >&2
"$VENV/bin/pip" install -q "${DEPS[@]}" >&2
# The client module's own file must be there; its import is checked by the tests (with the stand-in).
"$VENV/bin/python" - <<'PY' >&2
import importlib.util
spec = importlib.util.find_spec("skyrl")
assert spec is not None, "skyrl is not installed"
PY
echo "$RECIPE" >"$STAMP"
echo "$VENV"

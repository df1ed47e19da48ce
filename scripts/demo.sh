#!/usr/bin/env bash
# The main job on the embedded default, from a fresh clone: set up, then run the demo.
# Extra arguments go to `lorafleet demo` (e.g. scripts/demo.sh --resume).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/lorafleet demo "$@"

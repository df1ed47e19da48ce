# Shared steps of the cached real-framework venvs (sourced by scripts/setup-*.sh, not run).
# Each tier is a Python 3.11 venv under ~/.cache/lorafleet with torch==2.13.0 (+cpu, from the
# local wheel folder) installed first and pinned, so no later step can pull a CUDA build.

# venv_fresh VENV: an empty Python 3.11 venv at VENV (whatever was there is removed).
venv_fresh() {
  rm -rf "$1"
  mkdir -p "$(dirname "$1")"
  python3.11 -m venv "$1" >&2
}

# venv_torch VENV: torch==2.13.0 into VENV, and a constraints file that keeps it there.
venv_torch() {
  echo "torch==2.13.0" > "$1/lorafleet-constraints.txt"
  "$1/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" >&2
}

# venv_check_torch VENV: fail unless VENV's torch is still the CPU build installed first.
venv_check_torch() {
  "$1/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__ == '2.13.0+cpu' else 'torch is ' + torch.__version__)"
}

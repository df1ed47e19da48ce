#!/usr/bin/env bash
# Install the real-SGLang test tier (sglang 0.5.23, CPU engine) into its own cached venv.
# docs/engines/sglang.md has the why.
# Idempotent: a finished venv is reused (and the sgl_kernel stand-in re-synced). The last line
# printed is the venv path. Everything else goes to stderr.
set -euo pipefail
SGLANG_VERSION=0.5.23
HERE="$(cd "$(dirname "$0")" && pwd)"
SHIM="$HERE/sglang_cpu_shim/sgl_kernel"
# shellcheck source=scripts/_venv.sh
. "$HERE/_venv.sh"
VENV="${LORAFLEET_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/lorafleet/venv-sglang-$SGLANG_VERSION}"
STAMP="$VENV/.lorafleet-ready"
# What import, serving and runtime LoRA need on CPU (the recipe's list; docs/engines/sglang.md
# says why it is not trimmed). Installed under a torch==2.13.0 constraint; pip then reports that
# sglang requires torch==2.14.1 and CUDA packages: expected, and harmless here. triton is imported
# at module level by sglang.srt.utils.common, even on CPU.
DEPS=(
  aiohttp anthropic "blobfile==3.0.0" "compressed-tensors==0.18.0" einops fastapi gguf interegular
  IPython "llguidance>=1.7.6,<2" msgspec ninja numpy "openai==2.8.0" "openai-harmony==0.0.4" orjson
  packaging partial_json_parser pillow prometheus-client psutil pybase64 pydantic "python-dateutil<3"
  python-multipart pyzmq regex requests scipy "sentencepiece==0.2.1" setproctitle tiktoken
  "tokenizers==0.23.2" "transformers==5.19.0" "uvicorn>=0.51" uvloop watchfiles xxhash zstandard
  distro easydict dill "mistral_common>=1.11.5" "soundfile==0.13.1" "smg-grpc-servicer>=0.9.0"
  "kernels>=0.14.1,<0.15" "apache-tvm-ffi==0.1.11" "triton==3.9.0" "torchvision==0.28.*"
)
TV_GUARD='s|^@torch.library.register_fake\("torchvision::(q?nms)"\)$|@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))|'
# The stamp holds a digest of the recipe (versions, dependency list, torchvision guard), so a
# changed recipe rebuilds the venv and an edited comment does not.
RECIPE="$(printf '%s\n' "$SGLANG_VERSION" "${DEPS[@]}" "$TV_GUARD" | sha256sum | cut -c1-16)"

site_packages() { "$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }

install_shim() {
  # Our pure-torch sgl_kernel goes into site-packages: launching then needs no PYTHONPATH.
  local sp; sp="$(site_packages)"
  if ! diff -q "$SHIM/__init__.py" "$sp/sgl_kernel/__init__.py" >/dev/null 2>&1; then
    rm -rf "$sp/sgl_kernel"
    mkdir -p "$sp/sgl_kernel"
    cp "$SHIM/__init__.py" "$sp/sgl_kernel/__init__.py"
  fi
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ]; then
  install_shim
  echo "$VENV"
  exit 0
fi

start=$SECONDS
venv_fresh "$VENV"
# torch first and pinned for every later step: sglang pins torch==2.14.1, and letting pip resolve
# that pulls a multi-GB CUDA build. pip takes 2.13.0+cpu from the local wheel folder.
venv_torch "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
CONSTRAINTS="$VENV/lorafleet-constraints.txt"
# sglang's wheel hard-pins CUDA-only packages (flashinfer, sglang-kernel, deep-gemm, ...), so it goes
# in without its dependencies. xgrammar's only extra dependency is triton, added below.
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION" "xgrammar==0.2.7" >&2
"${PIP[@]}" -c "$CONSTRAINTS" "${DEPS[@]}" >&2
venv_check_torch "$VENV"

# The published torchvision wheel is linked against CUDA torch: with torch 2.13.0+cpu its fake-op
# registrations for torchvision::nms / ::qnms raise at import, and sglang imports torchvision
# unconditionally. Register them only when torchvision's compiled ops actually loaded.
TV="$(site_packages)/torchvision/_meta_registrations.py"
sed -i -E "$TV_GUARD" "$TV"
if [ "$(grep -c '_has_ops() else (lambda f: f)' "$TV")" != 2 ]; then
  echo "torchvision guard did not apply to $TV" >&2
  exit 1
fi

install_shim
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c "
import sgl_kernel, torchvision, sglang, sglang.launch_server, sglang.srt.entrypoints.http_server
import sglang.srt.lora.lora_manager
assert sglang.__version__ == '$SGLANG_VERSION', sglang.__version__
assert 'torchshim' in sgl_kernel.__version__, sgl_kernel.__file__
" >&2
echo "$RECIPE" > "$STAMP"
echo "sglang $SGLANG_VERSION installed in $((SECONDS - start)) s" >&2
echo "$VENV"

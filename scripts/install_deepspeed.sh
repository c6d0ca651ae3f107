#!/usr/bin/env bash
# Install DeepSpeed into a venv for the ZeRO-2/3 tests (two CPU ranks over gloo, DeepSpeed's CPU accelerator).
# Idempotent; prints the venv's python on its last line. Usage: bash scripts/install_deepspeed.sh [VENV]
#
# DS_BUILD_OPS=0: nothing is compiled at install (the wheel built from the sdist is pure Python, about 30 s here);
# ops DeepSpeed would JIT-compile are not needed by coordexp's runs (the CPU shm all-reduce op is switched off, see
# coordexp/runtime/train/deepspeed). torch and transformers are pinned to the installed versions, so the install
# never changes them. Failure to install is not fatal: the DeepSpeed tests then skip and say what is missing.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${1:-${COORDEXP_VENV:-$root/.venv}}"
py="$venv/bin/python"
deepspeed_version="0.19.8"

quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2; return "${PIPESTATUS[0]}"; }
importable() { "$py" -c "import importlib.metadata as m, sys
if m.version('deepspeed') != '$deepspeed_version': sys.exit(1)
import deepspeed" >/dev/null 2>&1; }

if ! importable; then
  echo "[deepspeed] installing deepspeed==$deepspeed_version (no ops compiled)" >&2
  pins=$(mktemp)
  "$py" - >"$pins" <<'PY'
import importlib.metadata as m
for dist in ("torch", "transformers", "accelerate"):
    try:
        print(f"{dist}=={m.version(dist)}")
    except m.PackageNotFoundError:
        pass
PY
  DS_BUILD_OPS=0 quiet "$py" -m pip -q install -c "$pins" "deepspeed==$deepspeed_version" \
    || echo "[deepspeed] pip failed; the DeepSpeed tests will skip" >&2
  rm -f "$pins"
  importable || echo "[deepspeed] deepspeed still does not import; the DeepSpeed tests will skip" >&2
fi
echo "$py"

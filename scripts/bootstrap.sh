#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install coordexp with the given extras.
# Usage: source-free; `bash scripts/bootstrap.sh test` prints the venv's python path on its last line.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${COORDEXP_VENV:-$root/.venv}"
extras="${1:-}"
python_bin="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[bootstrap] creating virtual environment at $venv" >&2
  "$python_bin" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)

# Re-install only when pyproject.toml or the requested extras change.
key=$(cat "$root/pyproject.toml" "$root/scripts/bootstrap.sh" | sha1sum | cut -c1-12)
stamp="$venv/.coordexp-installed-${key}-${extras:-base}"
if [ ! -f "$stamp" ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 && ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    # CPU-only machine: take the CPU build of torch first, so resolving `torch>=2.4` never pulls the multi-GB CUDA wheels.
    echo "[bootstrap] installing CPU torch==2.13.0" >&2
    "${pip[@]}" install -q "torch==2.13.0" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
    "$venv/bin/python" -c "import torch" || { echo "[bootstrap] torch install failed" >&2; exit 1; }
  fi
  spec="$root"
  [ -n "$extras" ] && spec="$root[$extras]"
  echo "[bootstrap] installing coordexp (${extras:-no extras})" >&2
  set +o pipefail
  "${pip[@]}" install -q -e "$spec" 2>&1 | grep -v "is ignored: it is neither" >&2
  status=${PIPESTATUS[0]}
  set -o pipefail
  [ "$status" -eq 0 ] || { echo "[bootstrap] pip install failed (exit $status)" >&2; exit "$status"; }
  rm -f "$venv"/.coordexp-installed-*
  touch "$stamp"
fi
echo "$venv/bin/python"

#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install coordexp with the given extras.
# Usage: source-free; `bash scripts/bootstrap.sh test` prints the venv's python path on its last line.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${COORDEXP_VENV:-$root/.venv}"
extras="${1:-}"
# The tests also cover the optional integrations that need no build (report_to: [tensorboard]); the demo's .venv
# (no extras) is unchanged.
[ "$extras" = test ] && extras="test,tensorboard"
python_bin="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[bootstrap] creating virtual environment at $venv" >&2
  "$python_bin" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)

# pip -q, minus the local index's "location is ignored" noise; a failed install prints its log and stops.
quiet_pip() {
  local log status=0
  log=$(mktemp)
  "${pip[@]}" -q "$@" >"$log" 2>&1 || status=$?
  grep -v "is ignored: it is neither" "$log" >&2 || true
  rm -f "$log"
  if [ "$status" -ne 0 ]; then
    echo "[bootstrap] pip $* failed (exit $status)" >&2
    exit "$status"
  fi
}

# Re-install only when the checkout (a venv shared by several clones holds an editable install of one of them),
# pyproject.toml, this script, the CPU pins or the requested extras change.
key=$({ echo "$root"; cat "$root/pyproject.toml" "$root/scripts/bootstrap.sh" "$root/scripts/constraints-cpu.txt"; } \
  | sha1sum | cut -c1-12)
stamp="$venv/.coordexp-installed-${key}-${extras:-base}"
if [ ! -f "$stamp" ]; then
  pins=()
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    # CPU-only machine: the versions the demo's figures were measured with (the file says why).
    pins=(-c "$root/scripts/constraints-cpu.txt")
    if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
      # Take the CPU build of torch first, so resolving `torch>=2.4` never pulls the multi-GB CUDA wheels.
      echo "[bootstrap] installing CPU torch==2.13.0" >&2
      quiet_pip install "torch==2.13.0"
    fi
  fi
  spec="$root"
  [ -n "$extras" ] && spec="$root[$extras]"
  echo "[bootstrap] installing coordexp (${extras:-no extras})" >&2
  quiet_pip install ${pins[@]+"${pins[@]}"} -e "$spec"
  find "$venv" -maxdepth 1 -name ".coordexp-installed-*" ! -name ".coordexp-installed-${key}-*" -delete
  touch "$stamp"
fi
echo "$venv/bin/python"

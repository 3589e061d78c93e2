#!/usr/bin/env bash
# Create .venv in the repository (if missing) and install the trainer's dependencies into it.
# Usage: ./scripts/install.sh [--dev] [--gpu | --cpu]
#   --dev   adds the test and tooling dependencies (requirements-dev.txt)
#   --gpu   adds the GPU-only ones (requirements-gpu.txt: torchao, for [float8]); by default they are
#           added when nvidia-smi lists a GPU on this machine; --cpu never adds them
set -euo pipefail
cd "$(dirname "$0")/.."
requirements=requirements.txt
gpu=auto
for arg in "$@"; do
    case "$arg" in
        --dev) requirements=requirements-dev.txt ;;
        --gpu) gpu=yes ;;
        --cpu) gpu=no ;;
        *) echo "error: unknown argument $arg; usage: $0 [--dev] [--gpu | --cpu]" >&2; exit 2 ;;
    esac
done
if [[ "$gpu" == auto ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=yes; else gpu=no; fi
fi
[[ -x .venv/bin/python ]] || python3 -m venv .venv
pip_install() {
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -r "$1" 2> >(grep -v "is ignored: it is neither" >&2)
    echo "installed $1 into .venv"
}
pip_install "$requirements"
if [[ "$gpu" == yes ]]; then pip_install requirements-gpu.txt; fi

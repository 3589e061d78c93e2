#!/usr/bin/env bash
# Create .venv in the repository (if missing) and install the trainer's dependencies into it.
# Usage: ./scripts/install.sh [--dev]     (--dev adds the test and tooling dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."
requirements=requirements.txt
[[ "${1:-}" == "--dev" ]] && requirements=requirements-dev.txt
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r "$requirements" 2> >(grep -v "is ignored: it is neither" >&2)
echo "installed $requirements into .venv"

#!/usr/bin/env bash
# Train on this machine with torchrun.
#   CONFIG_FILE  TOML recipe (default: train_configs/debug_model.toml)
#   NGPU         processes (default: the CUDA device count; 1 on a CPU-only machine)
#   LOG_RANK     ranks whose output is shown, e.g. 0 or 0,1 (default 0)
#   PYTHON       interpreter (default: the repository's .venv if present, else python3)
# Extra arguments go to train.py, e.g. ./run_llama_train.sh --training.steps 100
set -euo pipefail
root="$(cd "$(dirname "$0")" && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
CONFIG_FILE=${CONFIG_FILE:-"$root/train_configs/debug_model.toml"}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# Bad options, files, folders or degrees: one line and exit code 2 in a fraction of a second, before
# torch is even imported (the exit codes are listed in the README, "Reliability").
"$PYTHON" -m torchtitan.reliability.preflight ${NGPU:+--nproc "$NGPU"} --job.config_file "$CONFIG_FILE" "$@" || exit $?
if [[ -z "${NGPU:-}" ]]; then
    NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 1)")
fi
LOG_RANK=${LOG_RANK:-0}
if [[ "$NGPU" -gt 1 && -z "${OMP_NUM_THREADS:-}" ]] && ! "$PYTHON" -c "import torch,sys; sys.exit(not torch.cuda.is_available())"; then
    # CPU processes share the cores instead of each starting one thread per core.
    export OMP_NUM_THREADS=$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))
fi
# torchrun, passing SIGTERM/SIGUSR1 on to the workers (they save and exit 75) and exiting with the
# first failed rank's code in one line (torchtitan/reliability/launcher.py).
exec "$PYTHON" -m torchtitan.reliability.launcher --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    "$root/train.py" --job.config_file "$CONFIG_FILE" "$@"

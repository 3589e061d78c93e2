#!/usr/bin/env bash
# torchtitan 0.3.0 (PyPI wheel) on one GPU, Llama 3.2 1B shape with untied 128256-row embeddings,
# seq 2048 x local batch 4, one optimizer step per batch, bf16 (FSDP2 mixed precision, fp32
# master weights), per-block torch.compile + compiled loss, no activation checkpointing,
# fused AdamW lr 3e-4, 20 steps, a log line every step (tps, tflops, mfu, memory).
#
#   bash scripts/benchmarks/compare_torchtitan/run.sh OUT_DIR
#
# cwd must be our repository root (it has .whl/ and assets/). Offline: installs .whl/*.whl into
# /tmp/site unless torchtitan 0.3.0 is already importable from there. Writes
#   OUT_DIR/torchtitan.log           the full torchtitan log (+ the exit code as the last line)
#   OUT_DIR/torchtitan_summary.json  parse.py's result {"tps", "mfu", "memory_gib", "steps", ...}
#   OUT_DIR/dump/                    torchtitan's dump folder (structured logs)
# TT_MODEL=dsv3: DeepSeek-V3 at the 671B width, 2 layers, TT_EXPERTS experts, 1 x 4096 tokens
# (tt_dsv3_config.py) instead of the 1B.
# Knobs (environment): TT_MODEL (llama1b|dsv3), TT_STEPS (20), TT_ATTN (sdpa|flex), TT_LOSS (ce|chunked),
# TT_CUDA_GRAPHS (0|1), TT_SITE (/tmp/site), PYTHON (python3), TT_TIMEOUT (150).
set -u
OUT=${1:?usage: run.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(pwd)
PY=${PYTHON:-python3}
SITE=${TT_SITE:-/tmp/site}
LOG="$OUT/torchtitan.log"
: > "$LOG"

note() { echo "[run.sh] $*" | tee -a "$LOG"; }

[[ -d "$REPO/.whl" && -d "$REPO/assets" ]] || { note "cwd $REPO has no .whl/ or assets/"; exit 2; }

# Is torchtitan 0.3.0 (the wheel, not our repo's torchtitan/ package) importable from $SITE?
# Checked from / so that the repository's own torchtitan/ is not on sys.path.
have_tt() {
    (cd / && PYTHONPATH="$SITE" "$PY" -c "
import sys, torchtitan, tyro, torchdata, spmd_types, docstring_parser
assert torchtitan.__version__ == '0.3.0', torchtitan.__version__
assert torchtitan.__file__.startswith('$SITE'), torchtitan.__file__
" ) >>"$LOG" 2>&1
}
if have_tt; then
    note "torchtitan 0.3.0 already in $SITE"
else
    note "installing $REPO/.whl/*.whl into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$REPO"/.whl/*.whl >>"$LOG" 2>&1 || note "pip install returned $?"
    have_tt || { note "torchtitan 0.3.0 still not importable from $SITE (see above)"; exit 3; }
fi

export PYTHONPATH="$SITE:$HERE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ next to the runner (it may sit in the repo)
export TT_DUMP="$OUT/dump"
export TT_DATA="${TT_DATA:-$REPO/assets/corpus/kjv/train.jsonl}"
# The tokenizer without its chat_template.jinja: torchtitan 0.3.0 compiles a folder's chat template with
# plain jinja2, which refuses transformers' {% generation %} tag that ours has (TemplateSyntaxError
# before step 1); nothing here renders a conversation.
TOKENIZER_SRC="${TT_TOKENIZER:-$REPO/assets/tokenizer/kjv_bpe_hf}"
export TT_TOKENIZER="$OUT/tokenizer"
mkdir -p "$TT_TOKENIZER"
for f in tokenizer.json tokenizer_config.json; do
    [[ -f "$TOKENIZER_SRC/$f" ]] && cp "$TOKENIZER_SRC/$f" "$TT_TOKENIZER/"
done
export TT_STEPS="${TT_STEPS:-20}"
export TT_ATTN="${TT_ATTN:-sdpa}"
export TT_LOSS="${TT_LOSS:-ce}"
export TT_CUDA_GRAPHS="${TT_CUDA_GRAPHS:-0}"
if [[ "${TT_SMOKE:-0}" == 1 ]]; then  # CPU smoke test of this script (tiny model, no GPU)
    export TT_CPU=1 TT_TINY=1
else
    unset TT_CPU TT_TINY
fi
case "${TT_MODEL:-llama1b}" in
    llama1b) CONFIG=(--module tt_bench_config --config llama3_1b_bench) ;;
    dsv3) CONFIG=(--module tt_dsv3_config --config deepseek_v3_width_bench) ;;
    *) note "TT_MODEL=${TT_MODEL}: choose llama1b or dsv3"; exit 2 ;;
esac
note "model=${TT_MODEL:-llama1b} steps=$TT_STEPS attn=$TT_ATTN loss=$TT_LOSS cuda_graphs=$TT_CUDA_GRAPHS out=$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader >>"$LOG" 2>&1 || true

start=$(date +%s)
timeout -k 10 "${TT_TIMEOUT:-150}" "$PY" "$HERE/tt_bench.py" "${CONFIG[@]}" >>"$LOG" 2>&1
rc=$?
note "torchtitan exit code $rc after $(( $(date +%s) - start )) s"

"$PY" "$HERE/parse.py" "$LOG" > "$OUT/torchtitan_summary.json" 2>>"$LOG"
cat "$OUT/torchtitan_summary.json"
exit $rc

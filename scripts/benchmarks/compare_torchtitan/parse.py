"""Summarise a torchtitan 0.3.0 training log as JSON.

    python3 parse.py OUT_DIR/torchtitan.log [--skip 5]

torchtitan logs, per logged step (metrics.log_freq=1 here, colours off):
    ... - INFO - step:  7  loss:  9.12345  grad_norm:  1.2345  memory: 33.21GiB(41.95%)
                 tps: 51,234  tflops: 421.12  mfu: 42.58%
tps is tokens/s per GPU over the interval since the previous log line (so one step here),
memory the peak reserved CUDA memory in that interval, mfu = 100 * flops_per_token * tps / peak.

Prints {"tps", "mfu", "memory_gib", "steps", ...}: tps and mfu are the means over the logged steps
after the first `skip` (5: compilation and warm-up), memory_gib the largest peak-reserved value of
any logged step, steps the last step logged. Extra keys help checking the comparison.
"""

import json
import re
import statistics
import sys

STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+0-9.eEnaif]+)\s+grad_norm:\s*(?P<gn>[-+0-9.eEnaif]+)\s+"
    r"memory:\s*(?P<mem>[-0-9.]+)GiB\((?P<mempct>[-0-9.]+)%\)\s+tps:\s*(?P<tps>[0-9,]+)\s+"
    r"tflops:\s*(?P<tflops>[-0-9.,]+)\s+mfu:\s*(?P<mfu>[-0-9.]+%|N/A)"
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PEAK = re.compile(r"Peak FLOPS used for computing MFU:\s*([0-9.eE+]+)")
PARAMS = re.compile(r"size:\s*([0-9,]+) total parameters")
EXIT = re.compile(r"torchtitan exit code (\d+)")

# Our formula for the same shape (6 * non-embedding params incl. the untied lm_head
# + 12 * layers * heads * head_dim * seq); torchtitan's get_dense_model_nparams_and_flops is the
# same expression (6 * (params - embedding table) + 6 * L * H * (2 * head_dim) * seq).
_L, _H, _HD, _D, _F, _KV, _V, _S = 16, 32, 64, 2048, 8192, 8, 128256, 2048
_LAYER = (_D + 2 * _KV * _HD) * _D + _D * _D + 3 * _D * _F + 2 * _D
NONEMB_1B = _L * _LAYER + _D + _V * _D
FLOPS_PER_TOKEN_1B = 6 * NONEMB_1B + 12 * _L * _H * _HD * _S
H100_PEAK = 989e12


def parse(text: str, skip: int = 5) -> dict:
    text = ANSI.sub("", text)
    rows = {}
    for m in STEP.finditer(text):
        step = int(m["step"])
        rows[step] = {
            "step": step,
            "loss": float(m["loss"]),
            "memory_gib": float(m["mem"]),
            "tps": float(m["tps"].replace(",", "")),
            "tflops": float(m["tflops"].replace(",", "")),
            "mfu": None if m["mfu"] == "N/A" else float(m["mfu"].rstrip("%")),
        }
    rows = [rows[k] for k in sorted(rows)]
    out: dict = {"tps": None, "mfu": None, "memory_gib": None, "steps": 0}
    if m := PEAK.search(text):
        out["peak_flops"] = float(m[1])
    if m := PARAMS.search(text):
        out["model_params"] = int(m[1].replace(",", ""))
    if m := EXIT.search(text):
        out["exit_code"] = int(m[1])
    out["training_completed"] = "Training completed" in text
    if not rows:
        out["error"] = "no step lines found"
        return out
    steady = [r for r in rows if r["step"] > skip]
    out["steady_steps_used"] = [r["step"] for r in steady]
    if not steady:  # short run: fall back to everything after the first (compiling) step
        steady = [r for r in rows if r["step"] > 1] or rows
        out["warning"] = f"fewer than {skip + 1} steps logged; averaged steps {[r['step'] for r in steady]}"
    tps = [r["tps"] for r in steady]
    out["tps"] = statistics.fmean(tps)
    mfus = [r["mfu"] for r in steady if r["mfu"] is not None]
    out["mfu"] = statistics.fmean(mfus) if mfus else None
    out["memory_gib"] = max(r["memory_gib"] for r in rows)
    out["steps"] = rows[-1]["step"]
    out["tps_median"] = statistics.median(tps)
    out["tps_min"], out["tps_max"] = min(tps), max(tps)
    out["tflops"] = statistics.fmean(r["tflops"] for r in steady)
    if out["tps"] > 0:
        # torchtitan's flops/token, recovered from its printed tflops and tps (rounded values)
        out["flops_per_token_torchtitan"] = out["tflops"] * 1e12 / out["tps"]
    out["flops_per_token_ours_1b"] = FLOPS_PER_TOKEN_1B
    out["mfu_ours_formula"] = 100 * out["tps"] * FLOPS_PER_TOKEN_1B / H100_PEAK
    out["step1_tps"] = rows[0]["tps"] if rows[0]["step"] == 1 else None
    out["loss_first"], out["loss_last"] = rows[0]["loss"], rows[-1]["loss"]
    return out


def main() -> None:
    args = sys.argv[1:]
    skip = 5
    if "--skip" in args:
        i = args.index("--skip")
        skip = int(args[i + 1])
        del args[i : i + 2]
    if len(args) != 1:
        sys.exit("usage: parse.py LOG [--skip N]")
    with open(args[0], errors="replace") as f:
        print(json.dumps(parse(f.read(), skip), indent=1))


if __name__ == "__main__":
    main()

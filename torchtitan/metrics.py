"""What the trainer reports: a log line per logged step, metrics.jsonl, and W&B when enabled."""

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchtitan.config.options import JobConfig
from torchtitan.logging import logger
from torchtitan.models import spec

# Dense (no sparsity) peak FLOP/s from the vendors' datasheets, per device and matmul dtype.
# Matched in order against torch.cuda.get_device_name(), so a name that contains another comes first
# (GB200 before B200, GH200 and H200 NVL before H200). Anything not listed reports MFU as n/a:
# a wrong peak is worse than none. float32 is the plain FP32 rate, valid only while TF32 is off.
PEAK_FLOPS: list[tuple[str, dict[torch.dtype, float]]] = [
    ("GB200", {torch.bfloat16: 2500e12}),
    ("B200", {torch.bfloat16: 2250e12}),
    ("GH200", {torch.bfloat16: 989e12, torch.float32: 67e12}),
    ("H200 NVL", {torch.bfloat16: 835e12, torch.float32: 60e12}),
    ("H200", {torch.bfloat16: 989e12, torch.float32: 67e12}),
    ("H100 NVL", {torch.bfloat16: 835e12, torch.float32: 60e12}),
    ("H100 PCIe", {torch.bfloat16: 756e12, torch.float32: 51e12}),
    ("H100 SXM", {torch.bfloat16: 989e12, torch.float32: 67e12}),
    ("H100 80GB HBM3", {torch.bfloat16: 989e12, torch.float32: 67e12}),  # the SXM5 board's name
    ("A100", {torch.bfloat16: 312e12, torch.float32: 19.5e12}),
    ("MI300X", {torch.bfloat16: 1307.4e12, torch.float32: 163.4e12}),
    ("MI325X", {torch.bfloat16: 1307.4e12, torch.float32: 163.4e12}),
    ("L40S", {torch.bfloat16: 362e12, torch.float32: 91.6e12}),
]


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s for matmuls in `dtype`, or None when it is not known (never a
    guess): CPUs, unlisted GPUs, and float32 with TF32 enabled (whose peak is another figure)."""
    if device.type != "cuda":
        return None
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peaks in PEAK_FLOPS:
        if fragment in name:
            return peaks.get(dtype)
    return None


flops_per_token = spec.flops_per_token  # MFU's formula; each family's spec applies it


class _Colors:
    def __init__(self, enabled: bool) -> None:
        codes = {"cyan": 36, "green": 32, "yellow": 33, "blue": 34, "magenta": 35, "gray": 90, "red": 31}
        for name, code in codes.items():
            setattr(self, name, f"\033[{code}m" if enabled else "")
        self.reset = "\033[0m" if enabled else ""


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricLogger:
    """Turns a step's figures into rates over the steps since the last logged one (a window) and
    writes them to the log, metrics.jsonl and W&B. Only the rank that logs (rank 0) writes files.

    The loop calls `step_done()` after every step and `log(...)` at the steps `should_log` picks;
    the data loader's time is counted by iterating through `timed(batches)`."""

    def __init__(
        self,
        job_config: JobConfig,
        flops_per_token: int,
        peak_flops: float | None,
        tokens_per_step: float,
        device: torch.device,
        is_logging_rank: bool,
    ) -> None:
        self.total_steps = job_config.training.steps
        self.log_freq = job_config.metrics.log_freq
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.tokens_per_step = tokens_per_step
        self.device = device
        self.is_logging_rank = is_logging_rank
        self.compiled = job_config.training.compile
        color = job_config.metrics.enable_color_printing
        self.c = _Colors(sys.stdout.isatty() if color is None else color)
        self.jsonl = None
        self.wandb = None
        self._failed: set[str] = set()
        if is_logging_rank:
            dump_folder = job_config.job.dump_folder
            os.makedirs(dump_folder, exist_ok=True)
            self.jsonl = self._safely(
                "metrics.jsonl", lambda: open(os.path.join(dump_folder, "metrics.jsonl"), "a")
            )
            if job_config.metrics.enable_wandb:
                import wandb

                self.wandb = self._safely(
                    "W&B", lambda: wandb.init(dir=dump_folder, config=job_config.to_dict())
                )
        self.start = time.perf_counter()
        self._window_start, self._window_steps, self._data_time = self.start, 0, 0.0

    def _safely(self, sink: str, action: Callable[[], Any]) -> Any:
        """`action`'s result, or None if it fails: metrics are not worth stopping a run for, so a failed
        write to a sink (a full disk, a file-size limit, W&B unreachable) is one warning, the first time."""
        try:
            return action()
        except Exception as e:  # W&B raises its own errors
            if sink not in self._failed:
                self._failed.add(sink)
                logger.warning(
                    f"Cannot write {sink} ({e}); training goes on, further failures are not reported"
                )
            return None

    def _record(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl."""

        def write() -> None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()

        if self.jsonl is not None:
            self._safely("metrics.jsonl", write)

    def timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """`batches`, counting the time spent waiting for them as data time."""
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._data_time += time.perf_counter() - start
            yield batch

    def step_done(self) -> None:
        self._window_steps += 1

    def should_log(self, step: int) -> bool:
        """Every metrics.log_freq steps, the first and the last."""
        return step == 1 or step % self.log_freq == 0 or step == self.total_steps

    def memory(self) -> tuple[float, float]:
        """(peak GiB, % of device): on CUDA the peak reserved since the last call, on CPU the
        process's peak resident memory."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_reserved(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak / 2**30, 100 * peak / total
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return peak / 2**30, 100 * peak / total

    def log(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        skipped_steps: int,
        source_tokens: dict[str, int] | None = None,
        moe: dict[str, float] | None = None,
        trained_tokens: torch.Tensor | None = None,
    ) -> None:
        """Log the window that ends at `step`; `skipped_steps` counts the steps so far whose
        non-finite gradients were dropped; `source_tokens`: a mixture's tokens per source so far; `moe`:
        a mixture-of-experts model's `expert_load`, `aux_loss` and `seq_aux_loss` of the step
        (torchtitan/objective/load_balance.py), and multi-token prediction's `mtp_loss_k` per depth
        (torchtitan/objective/mtp.py);
        `trained_tokens`: chat data's tokens with a target in the step's global batch (tps counts all)."""
        now = time.perf_counter()
        step_time, steps = now - self._window_start, max(self._window_steps, 1)
        tps = self.tokens_per_step * self._window_steps / step_time if step_time > 0 else 0.0
        mfu = 100 * tps * self.flops_per_token / self.peak_flops if self.peak_flops else None
        mem_gib, mem_pct = self.memory()
        eta = (self.total_steps - step) * step_time / steps
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": tps,
            "mfu": mfu,
            "memory_gib": mem_gib,
            "memory_pct": mem_pct,
            "step_time": step_time / steps,
            "data_time_pct": 100 * self._data_time / step_time if step_time > 0 else 0.0,
            "elapsed": now - self.start,
            "time": time.time(),
            "skipped_steps": skipped_steps,
        }
        if source_tokens is not None:
            record["source_tokens"] = source_tokens
        record.update(moe or {})
        if trained_tokens is not None:
            record["trained_tokens"] = int(trained_tokens.item())
        if (
            self.compiled
        ):  # so far in this process: one graph per distinct block and one for the loss is ideal
            counters = torch._dynamo.utils.counters
            record["compiled_graphs"] = counters["stats"]["unique_graphs"]
            record["graph_breaks"] = sum(counters["graph_break"].values())
        if self.is_logging_rank:
            self._write(record, mfu, eta)
        self._window_start, self._window_steps, self._data_time = time.perf_counter(), 0, 0.0

    def _write(self, record: dict[str, Any], mfu: float | None, eta: float) -> None:
        c = self.c
        mfu_text = f"{mfu:.2f}%" if mfu is not None else "n/a"
        logger.info(
            f"{c.cyan}step: {record['step']:>{len(str(self.total_steps))}}/{self.total_steps}  "
            f"{c.green}loss: {record['loss']:7.4f}  "
            f"{c.yellow}grad_norm: {record['grad_norm']:7.4f}  "
            + (f"aux_loss: {record['aux_loss']:.4f}  " if "aux_loss" in record else "")
            + (f"seq_aux_loss: {record['seq_aux_loss']:.4f}  " if "seq_aux_loss" in record else "")
            + (f"expert_load: {record['expert_load']:.2f}  " if "expert_load" in record else "")
            + "".join(f"{key}: {value:.4f}  " for key, value in record.items() if key.startswith("mtp_loss_"))
            + f"{c.gray}lr: {record['lr']:.2e}  "
            f"{c.blue}tps: {record['tps']:,.0f}  "
            + (f"trained_tokens: {record['trained_tokens']:,}  " if "trained_tokens" in record else "")
            + f"{c.magenta}mfu: {mfu_text}  "
            f"{c.yellow}memory: {record['memory_gib']:.2f}GiB({record['memory_pct']:.1f}%)  "
            f"{c.gray}data: {record['data_time_pct']:.1f}%  "
            f"{c.gray}eta: {format_duration(eta)}{c.reset}"
        )
        self._record(record)
        if self.wandb is not None:
            metrics = {k: v for k, v in record.items() if v is not None and k != "step"}
            self._safely("W&B", lambda: self.wandb.log(metrics, step=record["step"]))

    def log_validation(
        self, step: int, loss: float, perplexity: float, tokens: int, seconds: float, data: str
    ) -> None:
        """Log an evaluation's result, naming the `data` scored, and leave its time out of the training
        window (tokens/s, MFU)."""
        self._window_start += seconds
        if not self.is_logging_rank:
            return
        logger.info(
            f"{self.c.green}validate step {step}: loss {loss:.4f}  perplexity {perplexity:.2f}  "
            f"({tokens:,} tokens of {data}, {seconds:.1f} s){self.c.reset}"
        )
        record = {
            "step": step,
            "validation_loss": loss,
            "validation_perplexity": perplexity,
            "validation_tokens": tokens,
            "validation_time": seconds,
            "time": time.time(),
        }
        self._record(record)
        if self.wandb is not None:
            metrics = {"validation/loss": loss, "validation/perplexity": perplexity}
            self._safely("W&B", lambda: self.wandb.log(metrics, step=step))

    def close(self) -> None:
        if self.jsonl is not None:
            self._safely("metrics.jsonl", self.jsonl.close)
        if self.wandb is not None:
            self._safely("W&B", self.wandb.finish)

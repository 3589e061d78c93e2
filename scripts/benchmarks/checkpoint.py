"""How long training is blocked by a checkpoint save, synchronous vs async (not a test).

Builds a ~134M-parameter Llama with AdamW (1.6 GB of state in fp32) and, a few times, takes a training
step and saves through CheckpointManager, timing the `save` call the training loop waits for: the whole
write for a sync save, the staging copy for an async one (the previous async save is waited for, untimed,
before each step: a real run saves seldom enough for it to be done). One process with a process group,
so async saves use the background writer process, as in a multi-rank run.

    .venv/bin/python scripts/benchmarks/checkpoint.py [--folder /tmp/benchmark_checkpoint]
        [--modes disabled async]
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere, uninstalled

from torchtitan.checkpoint.manager import CheckpointManager  # noqa: E402
from torchtitan.checkpoint.state import TrainState  # noqa: E402
from torchtitan.config.options import JobConfig  # noqa: E402
from torchtitan.models.llama import ModelArgs  # noqa: E402
from torchtitan.models.llama.model import Transformer  # noqa: E402
from torchtitan.optimizers import build_lr_scheduler, build_optimizer  # noqa: E402

MODEL = ModelArgs(dim=768, n_layers=12, n_heads=12, vocab_size=32000, multiple_of=256, max_seq_len=64)


class NoData:
    """The data loader's place in the checkpoint."""

    def state_dict(self) -> dict:
        return {"position": 0}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def run(mode: str, folder: str, saves: int, device: torch.device) -> list[float]:
    """Seconds the training loop is blocked by each save."""
    cfg = JobConfig()
    cfg.job.dump_folder = folder
    cfg.checkpoint.enable_checkpoint = True
    cfg.checkpoint.async_mode = mode
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(MODEL)
    model.init_weights(seed=0)
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, saves)
    checkpoint = CheckpointManager(model, optimizer, scheduler, NoData(), TrainState(), cfg)
    tokens = torch.randint(0, MODEL.vocab_size, (1, MODEL.max_seq_len + 1), device=device)
    blocked = []
    for step in range(1, saves + 1):
        checkpoint.wait()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        checkpoint.save(step)
        blocked.append(time.perf_counter() - start)
    checkpoint.close()
    return blocked


def part_checkpoint(tmp: str) -> dict:
    """benchmark.py's checkpoint part: the steady async save's blocked time over the sync one's,
    in one process with a process group (so async saves use the background writer process)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    folder = os.path.join(tmp, "checkpoint")
    sync = run(mode="disabled", folder=folder + "_sync", saves=3, device=device)
    async_ = run(mode="async", folder=folder + "_async", saves=3, device=device)
    dist.destroy_process_group()
    # The first async save also starts the background writer: the later ones are the steady state.
    sync_s, async_s = sum(sync) / len(sync), sum(async_[1:]) / len(async_[1:])
    return {"value": async_s / sync_s, "sync_blocked_s": sync, "async_blocked_s": async_}


def checkpoint_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    """benchmark.py's checkpoint row."""
    c = run_part("checkpoint")
    add(
        "checkpoint",
        c["value"],
        "<= 0.15",
        c["value"] <= 0.15,
        f"async save blocks {1e3 * sum(c['async_blocked_s'][1:]) / len(c['async_blocked_s'][1:]):.0f} ms, "
        f"sync {1e3 * sum(c['sync_blocked_s']) / len(c['sync_blocked_s']):.0f} ms "
        "(134M-param model + AdamW; async steady state, past the first save)",
        c,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "benchmark_checkpoint"))
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["disabled", "async"],
        choices=["disabled", "async", "async_with_pinned_mem"],
        help="checkpoint.async_mode values to compare; disabled is the sync save",
    )
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)

    num_params = Transformer(MODEL).num_params()
    print(
        f"setup: {num_params / 1e6:.0f}M-parameter Llama + AdamW ({num_params * 12 / 1e9:.2f} GB in fp32), "
        f"device {device}, {os.cpu_count()} CPUs, torch {torch.__version__}, writing to {args.folder}"
    )
    results = {}
    for mode in args.modes:
        shutil.rmtree(args.folder, ignore_errors=True)
        results[mode] = run(mode, args.folder, args.saves, device)
        print(f"{mode:>22}: training blocked {', '.join(f'{t:.2f}' for t in results[mode])} s per save")
    shutil.rmtree(args.folder, ignore_errors=True)
    if "disabled" in results:
        sync = sum(results["disabled"]) / len(results["disabled"])
        for mode in args.modes:
            if mode != "disabled":
                # The first async save also allocates the staging buffers, which later saves reuse.
                steady = results[mode][1:] or results[mode]
                mean = sum(steady) / len(steady)
                print(f"blocked per save, sync / {mode}: {sync:.2f} s / {mean:.2f} s = {sync / mean:.1f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

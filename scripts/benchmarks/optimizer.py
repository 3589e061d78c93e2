"""benchmark.py's optimizer rows: a step with Muon against one with AdamW, train.py on the debug
model (its matrices with Muon, Newton-Schulz in fp32 as on CPUs), on one process and on FSDP 2, where
each rank gathers every matrix it holds a shard of and orthogonalises it whole (docs/optimizers.md)."""

import os
from collections.abc import Callable

from scripts.benchmarks.step import ms, step_ratio, train_step_time

MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"]


def part_adamw(tmp: str) -> dict:
    return train_step_time(os.path.join(tmp, f"adamw-{os.environ.get('WORLD_SIZE', '1')}"), [])


def part_muon(tmp: str) -> dict:
    return train_step_time(os.path.join(tmp, f"muon-{os.environ.get('WORLD_SIZE', '1')}"), MUON)


def optimizer_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    for nproc, layout in ((1, "1 process"), (2, "FSDP 2")):
        adamw, muon = run_part("adamw", nproc), run_part("muon", nproc)
        ratio = step_ratio(muon, adamw)
        detail = f"train.py, debug model, Muon {ms(muon)} vs AdamW {ms(adamw)}, {layout}"
        add(f"Muon step time, {layout}", ratio, "(reported)", True, detail, {"muon": muon, "adamw": adamw})

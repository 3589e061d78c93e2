"""Launch torchtitan 0.3.0's trainer (torchtitan.train.main) with small compatibility shims.

Usage (one process, no torchrun needed; the env:// rendezvous variables are set here if absent):
    python tt_bench.py --module tt_bench_config --config llama3_1b_bench [--section.key value ...]

Shims (each only when needed, each logged):
  * torch 2.11 has no torch.distributed.fsdp.DataParallelMeshDims (torchtitan 0.3.0 imports it at
    module level in distributed/fsdp.py and distributed/full_dtensor.py). On one GPU with the
    default spmd_types backend torchtitan never constructs or passes it (resolve_fsdp_mesh
    returns None for a size-1 mesh), so a stand-in dataclass is enough for the imports.
  * If `import datasets` fails (it is only imported at module level by
    torchtitan/hf_datasets/text_datasets.py, whose HF loaders this runner does not use), a stub
    module is installed so the import chain works.
  * TT_CPU=1: CPU smoke test. torchtitan 0.3.0 has no CPU device path (tools/utils.py falls back
    to "cuda"), so the device type is forced to "cpu", the few torch.cuda-only calls it makes on
    torch.cpu get stand-ins, and the process group uses gloo. Never set on the GPU run.
"""

import dataclasses
import os
import sys
import types


def _log(msg: str) -> None:
    print(f"[tt_bench] {msg}", flush=True)


def _shim_torch() -> None:
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:  # stand-in; see module docstring
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        _log("shim: torch.distributed.fsdp.DataParallelMeshDims (absent in this torch)")

    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        # torchtitan.distributed.utils.set_pg_timeouts (called after step 1) uses the public
        # torch.distributed.set_timeout of newer torch; torch 2.11 has the private equivalent.
        from torch.distributed.distributed_c10d import _set_pg_timeout

        def set_timeout(timeout, group=None):
            _set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout
        _log("shim: torch.distributed.set_timeout -> distributed_c10d._set_pg_timeout")


def _shim_datasets() -> None:
    try:
        import datasets  # noqa: F401

        return
    except Exception as e:  # ImportError, or a version check inside datasets
        _log(f"shim: `import datasets` failed ({type(e).__name__}: {e}); installing a stub")

    def _unavailable(*args, **kwargs):
        raise RuntimeError("HF datasets is not available in this environment")

    mod = types.ModuleType("datasets")
    mod.Dataset = type("Dataset", (), {})
    mod.IterableDataset = type("IterableDataset", (), {})
    mod.load_dataset = _unavailable
    dist = types.ModuleType("datasets.distributed")
    dist.split_dataset_by_node = _unavailable
    mod.distributed = dist
    sys.modules["datasets"] = mod
    sys.modules["datasets.distributed"] = dist


def _shim_cpu() -> None:
    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    cpu = torch.cpu

    class _Props:
        name = "CPU"
        total_memory = 24 * 1024**3

    stand_ins = {
        "get_device_name": lambda *a, **k: "CPU",
        "get_device_properties": lambda *a, **k: _Props(),
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {},
        "manual_seed": torch.manual_seed,
        "manual_seed_all": torch.manual_seed,
    }
    for name, fn in stand_ins.items():
        if not hasattr(cpu, name):
            setattr(cpu, name, fn)
    _log("shim: CPU smoke-test mode (device type forced to cpu, gloo process group)")


def _shim_chunked_loss_fsdp_group() -> None:
    """TT_LOSS=chunked only. torchtitan 0.3.0 puts [norm, lm_head] in ONE FSDP unit, and its
    ChunkedLossWrapper calls lm_head.reshard() after the per-chunk lm_head backward, i.e. before
    the decoder backward that still needs the final norm's unsharded weight. Under torch 2.11
    FSDP2 that weight is then freed ("tensor ... data is not allocated yet" with bf16 params,
    a segfault with fp32 params). Shard lm_head alone instead: the final norm's weight then
    belongs to the root unit (fully_shard(model)), which stays unsharded through backward."""
    import torch.nn as nn

    import torchtitan.distributed.fsdp as tt_fsdp

    orig = tt_fsdp.fully_shard

    def fully_shard(module, *args, **kwargs):
        if (
            isinstance(module, (list, tuple))
            and len(module) == 2
            and isinstance(module[1], nn.Linear)
            and not isinstance(module[0], nn.Linear)
        ):
            _log("shim: FSDP unit [norm, lm_head] -> [lm_head] (norm joins the root unit)")
            return orig(module[1], *args, **kwargs)
        return orig(module, *args, **kwargs)

    tt_fsdp.fully_shard = fully_shard


def _shim_flex_block_mask() -> None:
    """torchtitan 0.3.0 calls create_block_mask(..., separate_full_blocks=...) (decoder.py), an
    argument torch 2.11 lacks. True (torchtitan's value outside batch-invariant mode) is what
    torch 2.11 always does, so drop the argument. Only matters for TT_ATTN=flex."""
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask

    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return
    import torchtitan.models.common.attention as attn
    import torchtitan.models.common.decoder as dec

    orig = attn.create_attention_mask

    def create_attention_mask(*args, **kwargs):
        if not kwargs.pop("separate_full_blocks", True):
            raise NotImplementedError("separate_full_blocks=False needs a newer torch")
        return orig(*args, **kwargs)

    attn.create_attention_mask = create_attention_mask
    dec.create_attention_mask = create_attention_mask
    _log("shim: create_block_mask(separate_full_blocks=...) dropped (absent in this torch)")


def main() -> None:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    here = os.path.dirname(os.path.abspath(__file__))

    # Our repository also has a top-level `torchtitan` package (our trainer). Keep any sys.path
    # entry holding a torchtitan/ that is not torchtitan 0.3.0 (no trainer.py) behind the others.
    def _foreign(entry: str) -> bool:
        d = os.path.join(os.path.abspath(entry or "."), "torchtitan")
        return os.path.isdir(d) and not os.path.isfile(os.path.join(d, "trainer.py"))

    front = [p for p in sys.path if not _foreign(p)]
    back = [p for p in sys.path if _foreign(p)]
    if back:
        _log(f"moved to the end of sys.path (they hold another torchtitan): {back}")
    sys.path[:] = front + back
    if here not in sys.path:
        sys.path.append(here)  # so --module tt_bench_config imports

    if os.environ.get("TT_CPU", "0") == "1":
        _shim_cpu()
    _shim_torch()
    _shim_datasets()

    import torch

    _log(
        f"torch {torch.__version__}, cuda available {torch.cuda.is_available()}, "
        f"python {sys.version.split()[0]}"
    )
    if torch.cuda.is_available():
        _log(f"device {torch.cuda.get_device_name(0)}")
    import torchtitan

    _log(f"torchtitan {getattr(torchtitan, '__version__', '?')} from {torchtitan.__file__}")
    if getattr(torchtitan, "__version__", None) != "0.3.0":
        _log("ERROR: this is not torchtitan 0.3.0 (is PYTHONPATH missing the wheel's site dir?)")
        sys.exit(4)

    if os.environ.get("TT_CPU", "0") == "1":
        # set_pg_timeouts (after step 1) calls barrier(device_ids=[current_device()]); with the
        # gloo group of the CPU test that must be a plain barrier. The timeout change still runs.
        import torch.distributed as dist

        orig_barrier = dist.barrier

        def barrier(*args, **kwargs):
            kwargs.pop("device_ids", None)
            return orig_barrier(*args, **kwargs)

        dist.barrier = barrier

    if os.environ.get("TT_ATTN", "sdpa") == "flex":
        _shim_flex_block_mask()
    if os.environ.get("TT_LOSS", "ce") == "chunked":
        _shim_chunked_loss_fsdp_group()

    from torchtitan.train import main as tt_main

    tt_main()


if __name__ == "__main__":
    main()

"""The benchmarks: two entry points, each over a module per group of what it measures.

- `benchmark.py`: the trainer's performance figures on any machine (2 CPU cores or a GPU), each a
  ratio of two things measured side by side; its rows come from `step.py` (framework overhead,
  compile, and the train.py timing the others share), `memory.py`, `checkpoint.py` (also a program
  of its own), `data.py`, `moe.py`, `context_parallel.py`, `attention.py` and `optimizer.py`.
- `benchmark_gpu.py`: the one-GPU figures in one call, its parts in `gpu_train.py` (train.py's
  recipes), `gpu_kernels.py` (expert and attention kernels against the CPU path) and
  `gpu_parallel.py` (context parallel and FSDP on one GPU), with `compare_torchtitan/` (the PyPI
  torchtitan wheel on the same shape) beside them.

The modules import each other as `scripts.benchmarks.<module>`, the repository root on sys.path (the
entry points put it there), so that their names never clash with top-level modules."""

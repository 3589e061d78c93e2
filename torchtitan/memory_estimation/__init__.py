"""A training job's peak memory per rank on fake tensors, without its hardware: the library of
scripts/estimate_memory.py."""

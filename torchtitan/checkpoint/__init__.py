"""Checkpoints: where a run's are and which one it resumes from (`folder.py`, torch-free, for the
preflight), what one holds (`state.py`), saving and resuming (`manager.py`: CheckpointManager),
loading into a run with every check first (`load.py`), each checkpoint's checksums (`checksums.py`)
and reading one without running code from it (`safe_reader.py`)."""

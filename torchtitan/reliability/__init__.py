"""What keeps a run's work safe and its failures short, in one place:

- errors.py: the exit codes and the one-line error contract every entry point keeps;
- preflight.py: the torch-free checks of a job, run before any worker starts;
- launcher.py: torchrun that forwards preemption signals and passes on the failed rank's code;
- guards.py: in the loop, preemption (save and stop) and non-finite steps;
- safe_dcp.py: reading checkpoints without running code from them.

Importing this package, errors, preflight or launcher does not import torch."""

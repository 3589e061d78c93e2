"""The entry points' side of reliability, in one place:

- preflight.py: the torch-free checks of a job, run before any worker starts;
- launcher.py: torchrun that forwards preemption signals and passes on the failed rank's code;
- entry.py: the shape every job entry point shares (stop with the launcher, parse, preflight, hold the
  dump folder, run);
- dump_lock.py: one job per dump folder;
- guards.py: in the loop, preemption (save and stop) and non-finite steps.

The exit codes and the one-line error contract are torchtitan/errors.py's, the path rules
torchtitan/config/paths.py's and checkpoint reading that runs no code
torchtitan/checkpoint/safe_reader.py's, outside this package: the layers listed before reliability in
docs/architecture.md use them, and import nothing from here. Importing this package, preflight or
launcher does not import torch."""

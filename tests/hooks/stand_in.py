"""A stand-in for train.py, to test the launcher alone in a second: `stand_in.py MODE FOLDER`, on 2 ranks.
Each rank writes `FOLDER/started-rank-R`, then, with SIGTERM's default action (as a trainer has before
it can handle one, or while its interpreter tears down):

- MODE `sleep`: sleeps a minute;
- MODE `exit-CODE`: rank 0 sleeps; rank 1 exits with CODE once rank 0 has started, just after a
  second begins, so that torchrun's agent stops rank 0 within the same second (its timestamps are
  whole seconds; the launcher reported the lower rank of a tie)."""

import os
import sys
import time

mode, folder = sys.argv[1:3]
rank = int(os.environ["RANK"])
with open(os.path.join(folder, f"started-rank-{rank}"), "w"):
    pass
if mode.startswith("exit-") and rank == 1:
    while not os.path.exists(os.path.join(folder, "started-rank-0")):
        time.sleep(0.01)
    time.sleep(1.02 - time.time() % 1)
    sys.exit(int(mode.removeprefix("exit-")))
time.sleep(60)

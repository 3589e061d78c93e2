"""tests/fork_server.py's forked torchrun workers are what torchrun's new interpreters are to the
program they run: the same argv, sys.path, environment, session, signal handlers and stdio, and
their exit codes reach torchrun as theirs; and they were forked before the agent ran a thread. So
are the ranks it starts for scripts/chaos.py, to subprocess.Popen's."""

import json
import os
import subprocess
import sys
from pathlib import Path

from launch import ROOT, launch_env, run_forked, start_forked

PROBE = """
import json, os, signal, sys

FORKED = "torch" in sys.modules  # imported before the program started
PER_RUN = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "PYTEST_CURRENT_TEST",
           "TITAN_TEST_NEW_INTERPRETERS")
STDIO = (sys.stdout, sys.stderr)  # `python -u`: unbuffered
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGCHLD)

def process_group():
    if os.getpgid(0) == os.getpid():
        return "own"
    return "the caller's" if sys.argv[2:] == [str(os.getpgid(0))] else "another"  # argv: the caller's


# Whether this process began before every thread of its parent (the agent) but the first: forked, it
# inherited no lock one of them held. Start times in clock ticks since boot, /proc's 22nd field.
def started_before_the_agents_threads():
    def start(stat):
        with open(stat) as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    agent = os.getppid()
    threads = [t for t in os.listdir(f"/proc/{agent}/task") if int(t) != agent]
    return all(start("/proc/self/stat") <= start(f"/proc/{agent}/task/{t}/stat") for t in threads)


def main():
    rank = int(os.environ["RANK"])
    seen = {
        "forked": FORKED,
        "before the agent's threads": started_before_the_agents_threads(),
        "argv": sys.argv,
        "orig_argv": sys.orig_argv[1:],
        "path0": sys.path[0],
        "session leader": os.getsid(0) == os.getpid(),
        "process group": process_group(),
        "environment": {k: v for k, v in os.environ.items() if k not in PER_RUN},
        "signals": {s.name: repr(signal.getsignal(s)) for s in SIGNALS},
        "stdio": [(f.line_buffering, f.write_through, type(f.buffer).__name__, f.errors) for f in STDIO],
        "stdin": os.isatty(0),
    }
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    print(f"rank {rank} ends with {3 * rank}")
    sys.exit(3 * rank)


if __name__ == "__main__":  # the fork server imports the script once, before the runs
    main()
"""


def launch(folder: Path, env: dict[str, str]) -> tuple[list[dict], str]:
    folder.mkdir()
    script = folder / "probe.py"
    script.write_text(PROBE)
    torchrun = ["--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
    result = run_forked("module", "torch.distributed.run", [*torchrun, str(script), str(folder)], env)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]  # torchrun's, a rank failed
    seen = [(folder / f"rank{rank}.json").read_text().replace(str(folder), "<folder>") for rank in (0, 1)]
    return [json.loads(text) for text in seen], result.stdout + result.stderr


def test_forked_workers_see_what_new_interpreters_see(tmp_path):
    forked, forked_out = launch(tmp_path / "forked", launch_env())
    new, new_out = launch(tmp_path / "new", launch_env(TITAN_TEST_NEW_INTERPRETERS="1"))
    assert [rank.pop("forked") for rank in forked + new] == [True, True, False, False]
    # Forked while the agent ran one thread (fork_server.WorkerShells); new interpreters start later.
    assert [rank.pop("before the agent's threads") for rank in forked] == [True, True]
    for rank in new:
        rank.pop("before the agent's threads")
    assert forked == new
    for out in (forked_out, new_out):
        assert "rank 0 ends with 0" in out and "rank 1 ends with 3" in out
        assert "exitcode  : 3 (pid:" in out  # torchrun's report of rank 1's failure


def start_ranks(folder: Path, popen) -> tuple[list[dict], list[str]]:  # noqa: ANN001
    """The probe on 2 ranks as scripts/chaos.py's Job starts them, with `popen`."""
    folder.mkdir()
    script = folder / "probe.py"
    script.write_text(PROBE)
    ranks = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        env.update(PYTHONUNBUFFERED="1")
        with open(folder / f"rank{rank}.log", "w") as log:
            cmd = [sys.executable, str(script), str(folder), str(os.getpgid(0))]
            ranks.append(popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    assert [rank.wait(60) for rank in ranks] == [0, 3]
    seen = [(folder / f"rank{rank}.json").read_text().replace(str(folder), "<folder>") for rank in (0, 1)]
    return [json.loads(text) for text in seen], [(folder / f"rank{rank}.log").read_text() for rank in (0, 1)]


def test_started_ranks_see_what_popen_ranks_see(tmp_path):
    forked, forked_out = start_ranks(tmp_path / "forked", start_forked)
    new, new_out = start_ranks(tmp_path / "new", subprocess.Popen)
    assert [rank.pop("forked") for rank in forked + new] == [True, True, False, False]
    for rank in forked + new:  # their parent is the fork server, not torchrun's agent
        rank.pop("before the agent's threads")
    assert forked == new
    assert forked[0]["process group"] == "the caller's"
    assert forked_out == new_out == ["rank 0 ends with 0\n", "rank 1 ends with 3\n"]

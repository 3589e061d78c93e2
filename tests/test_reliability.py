"""Preemption, crashes, a dead launcher, dead and hung ranks, non-finite steps: end to end on CPU with 2
processes.

The jobs come from scripts/chaos.py: 2 ranks started directly (the environment torchrun would give
them), so that one rank can be signalled, stopped or killed alone; or from run_llama_train.sh where the
launcher matters."""

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import ROOT, TINY_JOB, read_metrics, run_train_in_process
from torch.distributed.checkpoint.utils import _wrap_exception
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from scripts import chaos
from torchtitan.checkpoint.safe_reader import read_checkpoint
from torchtitan.config.options import CommConfig
from torchtitan.config.parser import parse_args
from torchtitan.errors import EXIT_DATA, EXIT_PREEMPTED, comm_failure_message
from torchtitan.reliability import launcher as launcher_module
from torchtitan.reliability.dump_lock import LOCK_NAME
from torchtitan.reliability.entry import StoppedEarly, stopped_early, stopped_early_line
from torchtitan.reliability.guards import StopRequest
from torchtitan.reliability.launcher import LAUNCHER_PID_ENV

HOOKS = ROOT / "tests" / "hooks"  # test-only behaviour of launched trainers (its sitecustomize.py)
# The jobs here are scripts/chaos.py's without the validation pass over the whole held-out split that
# ends a run (8 to 12 s of a 2-rank run): no assertion in this file reads it, and a resumed run
# validates in test_pretokenized.py.
NO_VALIDATION = ("--validation.enable", "false")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every interrupted one must reproduce, bit for bit."""
    folder = tmp_path_factory.mktemp("reference")
    chaos.run_to_end(2, folder, *NO_VALIDATION)
    return folder


def wait_for(condition, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_chaos_kills_then_resumes_exactly(reference, tmp_path):
    """SIGKILL of every rank while a checkpoint is being written, then, in the relaunched job, of
    rank 1 alone after a step: the job resumes each time from the last complete checkpoint and ends
    exactly like the reference (scripts/chaos.py --trials N runs random variations of this)."""
    mid_save = chaos.kill_once(2, tmp_path, "save", 0, [0, 1], 0.0, *NO_VALIDATION)
    assert "killed ranks [0, 1]" in mid_save, mid_save
    one_rank = chaos.kill_once(2, tmp_path, "step", chaos.STEPS - 2, [1], 0.1, *NO_VALIDATION)
    assert "killed ranks [1]" in one_rank and "exit codes [4, -9]" in one_rank, one_rank
    chaos.run_to_end(2, tmp_path, *NO_VALIDATION)
    chaos.compare(tmp_path, reference)


def hooked(hook: str, folder: Path) -> dict[str, str]:
    """The environment that turns on tests/hooks/sitecustomize.py's `hook` in a launched job's trainers,
    its files in `folder`."""
    folder.mkdir(exist_ok=True)
    path = os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "TITAN_TEST_HOOK": hook, "TITAN_TEST_HOOK_DIR": str(folder)}


def test_stop_signals_save_and_resume_exactly(reference, tmp_path):
    """SIGTERM to the launcher (run_llama_train.sh, as a scheduler sends it): the workers finish the
    step, save and exit 75, rank 0 slow to end (the hook `linger`: as on a busy machine, it is still
    tearing down when rank 1 has ended and torchrun's agent sends it SIGTERM): it is not killed, and the
    job's code is 75 (issue #42: it was 143 a quarter of the time). The next launch resumes exactly;
    SIGUSR1 to its rank 1 only: both ranks still stop after the same step and save."""
    args = [*chaos.JOB, *NO_VALIDATION, "--checkpoint.interval", "100", "--job.dump_folder", str(tmp_path)]
    hook = tmp_path / "hook"
    env = {**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1", **hooked("linger", hook)}
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen(
            [str(ROOT / "run_llama_train.sh"), *args], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        wait_for(lambda: chaos.last_step((tmp_path / "launcher.log").read_text()) >= 1)
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(120)
    out = (tmp_path / "launcher.log").read_text()
    assert (hook / "lingering-rank-0").exists(), out[-3000:]
    assert code == 75, out[-3000:]
    assert (hook / "left-rank-0").exists(), "rank 0 was killed while it ended"
    assert "killed" not in out, out[-3000:]
    first_stop = chaos.last_step(out)
    assert f"Stopped by SIGTERM after step {first_stop}; saved checkpoint step-{first_stop}" in out
    assert first_stop < chaos.STEPS and "Traceback" not in out
    assert chaos.complete_checkpoints(tmp_path) == [f"step-{first_stop}"]

    job = chaos.Job(2, tmp_path, *args)
    wait_for(lambda: chaos.last_step(job.output(0)) > first_stop)
    job.signal([1], signal.SIGUSR1)
    assert job.wait(120) == [75, 75], job.output(0)[-3000:]
    second_stop = chaos.last_step(job.output(0))
    assert f"Stopped by SIGUSR1 after step {second_stop}" in job.output(1)
    assert f"Stopped by a signal on another rank after step {second_stop}" in job.output(0)
    assert second_stop < chaos.STEPS
    assert chaos.complete_checkpoints(tmp_path) == [f"step-{second_stop}"]  # keep_latest_k = 1

    # Each launch resumed from the previous one's checkpoint: the losses are the reference's, bit for bit.
    expected, logged = dict(chaos.losses(reference)), chaos.losses(tmp_path)
    assert sorted(step for step, _ in logged) == list(range(1, second_stop + 1))
    assert [loss for _, loss in logged] == [expected[step] for step, _ in logged]


def stand_in_job(folder: Path, mode: str, *torchrun: str) -> subprocess.Popen:
    """The launcher on 2 ranks of tests/hooks/stand_in.py (no torch in the workers: a launch costs the
    launcher's start only), its output in `{folder}/launcher.log`."""
    cmd = [sys.executable, "-m", "torchtitan.reliability.launcher", "--nproc_per_node=2", "--rdzv_backend"]
    cmd += ["c10d", *torchrun, str(HOOKS / "stand_in.py"), mode, str(folder)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(folder / "launcher.log", "w") as log:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (/proc's SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    (mask,) = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
    return bool(int(mask, 16) >> (sig - 1) & 1)


@pytest.mark.parametrize("when", ["agent", "starting", "before"])
def test_launcher_reports_a_stop_not_the_kills_it_caused(tmp_path, when):
    """The launcher's own part of a stop, with ranks that die of SIGTERM (stand-ins: no handler), each
    time exit code 75 (it was 143):
    - agent: rank 1 exits 75 and torchrun's agent sends SIGTERM to rank 0, still running, which dies of
      it: a kill the launcher caused, not the job's outcome (issue #42);
    - starting: SIGTERM to the launcher, passed on to ranks that cannot handle it yet (a trainer's
      first seconds: its imports): preempted;
    - before: SIGTERM to the launcher while it waits for the other node (--nnodes 2), before any
      worker starts: preempted, nothing to save."""
    torchrun = ["--nnodes=2", f"--rdzv_endpoint=localhost:{chaos.free_port()}"] if when == "before" else []
    torchrun = torchrun or ["--rdzv_endpoint=localhost:0"]
    launcher = stand_in_job(tmp_path, "exit-75" if when == "agent" else "sleep", *torchrun)
    try:
        if when == "starting":
            wait_for(lambda: len(list(tmp_path.glob("started-rank-*"))) == 2, 60)
            launcher.send_signal(signal.SIGTERM)
        if when == "before":
            wait_for(lambda: catches(launcher.pid, signal.SIGTERM), 60)
            launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(60)
    finally:  # a launcher still running is killed, with its workers (each in a session of its own)
        for pid in [launcher.pid, *descendants(launcher.pid)] if launcher.poll() is None else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(30)
    out = (tmp_path / "launcher.log").read_text()
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert "error:" not in out and "Traceback" not in out, out[-3000:]
    assert "failed (exitcode" not in out, out[-3000:]  # torchrun's line for a rank it deems failed
    expected = {
        "agent": "Sending process",  # torchrun's log: its agent did send SIGTERM
        "starting": "launcher: rank 0 was stopped by SIGTERM as it started, before it could handle it; "
        "nothing to save: launch the same job again",
        "before": "launcher: stopped by SIGTERM before the workers started; nothing to save: launch the "
        "same job again",
    }[when]
    assert expected in out, out[-3000:]


def failure(rank: int, pid: int, code: int, timestamp: int) -> ProcessFailure:
    f = ProcessFailure(local_rank=rank, pid=pid, exitcode=code, error_file="/nonexistent")
    f.timestamp = timestamp
    return f


def test_launcher_cause_order():
    """Which failed rank the launcher reports: the first to fail of its own, 4 (a lost peer) only when
    no other, and never a rank its agent stopped (killed, or stopped: 75) while another is known."""
    watch = launcher_module._AgentWatch()
    watch.closed = {100}  # rank 0's pid: the agent sent it its closing signal
    cases = [
        ({0: failure(0, 100, -signal.SIGTERM, 5), 1: failure(1, 101, 75, 5)}, 1),
        ({0: failure(0, 100, -signal.SIGKILL, 5), 1: failure(1, 101, 3, 9)}, 1),  # killed 30 s on
        ({0: failure(0, 100, 75, 5), 1: failure(1, 101, 6, 5)}, 1),  # stopped by the agent at start-up
        ({0: failure(0, 100, -signal.SIGTERM, 5), 1: failure(1, 101, 4, 5)}, 1),  # a lost peer, still
        ({0: failure(0, 100, 2, 5), 1: failure(1, 101, 75, 5)}, 0),  # its own failure, though signalled
        ({0: failure(0, 102, -signal.SIGKILL, 5), 1: failure(1, 101, 4, 5)}, 0),  # OOM-killed: the cause
        ({0: failure(0, 102, 75, 5), 1: failure(1, 101, 75, 5)}, 0),  # a tie: the lower rank
    ]
    for failures, cause in cases:
        assert launcher_module._cause(failures, watch)[0] == cause, failures


def test_launcher_repeats_a_hidden_ranks_line_only_when_no_shown_rank_printed_it():
    """LOG_RANK 0 hides rank 1: its one line is repeated when it is the cause, unless rank 0 printed the
    same line (bad input every rank sees, rank 1 a second sooner: the line came twice in CI)."""
    bad_input = (
        "error: model.vocab_size: 10 is smaller than the tokenizer's 2256 tokens; use -1 or a larger value"
    )
    rank0, rank1 = failure(0, 100, 2, 6), failure(1, 101, 2, 5)
    rank0.message = rank1.message = bad_input
    assert not launcher_module._unseen(rank1, {0: rank0, 1: rank1}, "0")
    assert not launcher_module._unseen(rank1, {0: rank0, 1: rank1}, "1")  # rank 1 shown: printed
    rank1.message = "error: rank 1: data loading worker 0 (pid 7) was killed by SIGKILL"
    assert launcher_module._unseen(rank1, {0: rank0, 1: rank1}, "0")


def test_stop_before_training_starts(tmp_path):
    """SIGTERM to the launcher while the workers start up (the hook `slow_start` holds each one where it
    builds the tokenizer, as while a large model is built): nothing to save, but a preemption all the
    same: exit 75, rank 0's one line says what the next launch does; no kill, no traceback."""
    hook = tmp_path / "hook"
    with launched(tmp_path, env=hooked("slow_start", hook)) as launcher:
        wait_for(lambda: len(list(hook.glob("starting-rank-*"))) == 2 or launcher.poll() is not None)
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(60)
    out = (tmp_path / "launcher.log").read_text()
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert (
        "WARNING Stopped by SIGTERM before training started; nothing to save: launch the same job again "
        "to start over"
    ) in out, out[-3000:]
    assert "Traceback" not in out and "error:" not in out and "killed" not in out, out[-3000:]
    assert chaos.complete_checkpoints(tmp_path) == [] and not (tmp_path / LOCK_NAME).exists()


def test_worker_of_a_dead_launcher_stops_at_start(tmp_path):
    """A worker whose launcher died before it could ask for SIGTERM at its death (entry.stop_with_launcher)
    stops at once: exit 75 and one line, as any stop before training (it was killed by SIGTERM)."""
    env = {
        **os.environ,
        "TORCHELASTIC_RUN_ID": "test",
        LAUNCHER_PID_ENV: "1",  # not the worker's parent (this process): dead, as far as it can tell
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    job = [sys.executable, str(ROOT / "train.py"), *TINY_JOB, "--job.dump_folder", str(tmp_path)]
    done = subprocess.run(job, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_PREEMPTED, done.stderr[-3000:]
    assert "Stopped by SIGTERM before training started; nothing to save: launch the same job again" in (
        done.stdout + done.stderr
    )
    assert "Traceback" not in done.stderr


def test_stopped_early_line(tmp_path):
    """What the next launch of a job stopped before training starts from: the checkpoint it would load."""
    argv = [*TINY_JOB, "--job.dump_folder", str(tmp_path), "--checkpoint.enable_checkpoint", "true"]
    start = "Stopped by SIGUSR1 before training started; nothing to save: launch the same job again"
    assert stopped_early_line("SIGUSR1", parse_args(argv), trains=True) == f"{start} to start over"
    for step in (2, 4):
        (tmp_path / "checkpoint" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "checkpoint" / f"step-{step}" / ".metadata").touch()
    (tmp_path / "checkpoint" / "step-6").mkdir()  # incomplete: never loaded
    line = stopped_early_line("SIGUSR1", parse_args(argv), trains=True)
    assert line == f"{start} to resume from checkpoint step-4"
    line = stopped_early_line("SIGUSR1", parse_args([*argv, "--checkpoint.load_step", "2"]), trains=True)
    assert line == f"{start} to resume from checkpoint step-2"
    off = [*argv, "--checkpoint.enable_checkpoint", "false", "--checkpoint.initial_load_path", str(tmp_path)]
    line = stopped_early_line("SIGUSR1", parse_args(off), trains=True)
    assert line == f"{start} to start over from checkpoint.initial_load_path"
    assert stopped_early_line("SIGUSR1", None, trains=True) == start
    line = stopped_early_line("SIGUSR1", parse_args(argv), trains=False)  # scripts/evaluate.py
    assert line == "Stopped by SIGUSR1; nothing to save: launch the same job again"


def test_stopped_early_found_inside_a_checkpoint_exception():
    """A stop while DCP loads a checkpoint reaches the entry point wrapped in a CheckpointException."""
    try:
        raise StoppedEarly("SIGTERM")
    except StoppedEarly as e:
        wrapped = dcp.CheckpointException("load", {0: _wrap_exception(e)})
    assert stopped_early(wrapped).signal_name == "SIGTERM"
    assert stopped_early(RuntimeError("no")) is None


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def children(pid: int) -> list[int]:
    pids = []
    for path in (f"/proc/{pid}/task/{task}/children" for task in os.listdir(f"/proc/{pid}/task")):
        with contextlib.suppress(FileNotFoundError), open(path) as f:
            pids += [int(child) for child in f.read().split()]
    return pids


def descendants(pid: int) -> list[int]:
    return [d for child in children(pid) for d in (child, *descendants(child))]


@contextlib.contextmanager
def subreaper() -> Iterator[None]:
    """Orphans among this process's descendants become its children, not init's: a test can wait for
    a dead launcher's workers (and read their exit codes), and they stay zombies until it does.
    On leaving, every orphan is waited for (a trainer's data workers die with it); children this
    process had before (multiprocessing's resource tracker, which lives as long as it does) are not."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    earlier = set(children(os.getpid()))
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        yield
    finally:
        prctl(PR_SET_CHILD_SUBREAPER, 0)
        for pid in set(children(os.getpid())) - earlier:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def exit_codes(pids: list[int], timeout: float) -> list[int | None]:
    """The exit codes of this process's children `pids` (negative: killed by that signal); None for
    one still running at `timeout`."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in set(pids) - set(codes):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    return [codes.get(pid) for pid in pids]


def trained_steps(dump_folder) -> int:
    """Steps rank 0 has logged so far (metrics.jsonl is flushed at each record)."""
    with contextlib.suppress(FileNotFoundError):
        return (dump_folder / "metrics.jsonl").read_text().count("\n")
    return 0


def test_dead_launcher_stops_workers_like_preemption(reference, tmp_path):
    """SIGKILL of the launcher alone (the OOM killer, `kill -9 <torchrun pid>`): the workers, each in a
    session of its own, do not train on as orphans: within two steps they save and exit 75, the dump
    folder's lock is free, and the relaunch ends exactly like the reference."""
    args = [*chaos.JOB, *NO_VALIDATION, "--job.dump_folder", str(tmp_path)]
    env = {**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1"}
    with subreaper(), open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen(
            [str(ROOT / "run_llama_train.sh"), *args], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        wait_for(lambda: trained_steps(tmp_path) >= 1)
        workers = children(launcher.pid)
        launcher.kill()
        killed_after = trained_steps(tmp_path)
        assert launcher.wait(30) == -signal.SIGKILL
        assert len(workers) == 2 and exit_codes(workers, 120) == [EXIT_PREEMPTED] * 2
    stopped = trained_steps(tmp_path)
    assert killed_after <= stopped <= killed_after + 2 and stopped < chaos.STEPS
    assert chaos.complete_checkpoints(tmp_path) == [f"step-{stopped}"]
    assert not (tmp_path / LOCK_NAME).exists()
    chaos.run_to_end(2, tmp_path, *NO_VALIDATION)
    chaos.compare(tmp_path, reference)


def data_worker(launcher: int, rank: int) -> int:
    """The pid of `rank`'s data loading worker (training.data_workers = 1) in the job of `launcher`: its
    trainer's child running the same program (multiprocessing's resource tracker runs another)."""
    (trainer,) = [
        pid
        for pid in children(launcher)
        if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    ]
    program = Path(f"/proc/{trainer}/cmdline").read_bytes()
    (worker,) = [pid for pid in children(trainer) if Path(f"/proc/{pid}/cmdline").read_bytes() == program]
    return worker


@contextlib.contextmanager
def launched(dump_folder: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """run_llama_train.sh on 2 ranks with LOG_RANK=0 (its output in `{dump_folder}/launcher.log`), `env`
    added to its environment; on leaving, a job still running is woken and killed, its whole process
    tree."""
    env = {**os.environ, "NGPU": "2", "LOG_RANK": "0", "OMP_NUM_THREADS": "1", **(env or {})}
    job = [*chaos.JOB, *NO_VALIDATION, "--job.dump_folder", str(dump_folder), *args]
    with subreaper(), open(dump_folder / "launcher.log", "w") as log:
        launcher = subprocess.Popen(
            [str(ROOT / "run_llama_train.sh"), *job], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            yield launcher
        finally:
            tree = [launcher.pid, *descendants(launcher.pid)] if launcher.poll() is None else []
            for sig in (signal.SIGCONT, signal.SIGKILL):
                for pid in tree:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            launcher.wait(30)


def test_failure_of_every_rank_is_reported_though_a_rank_is_slow_to_end(tmp_path):
    """A failure every rank explains alike (here bad input only a worker can see, exit 2: the launcher
    passes it on without torchrun's ChildFailedError traceback), rank 0 slow to end (the hook `linger`,
    as in test_stop_signals_save_and_resume_exactly): torchrun's agent, seeing rank 1's exit, sends
    rank 0 SIGTERM, which does not kill it; the job's code is 2, with its one line (it was 143 when the
    two ends fell in the same second; twice when rank 1 failed a second sooner). Every code a rank
    decides ends so."""
    hook = tmp_path / "hook"
    with launched(tmp_path, "--model.vocab_size", "10", env=hooked("linger", hook)) as launcher:
        code = launcher.wait(300)
    out = (tmp_path / "launcher.log").read_text()
    assert (hook / "lingering-rank-0").exists(), out[-3000:]
    assert code == 2, out[-3000:]
    assert (hook / "left-rank-0").exists(), "rank 0 was killed while it ended"
    assert [line for line in out.splitlines() if "error:" in line] == [
        "[rank0]:error: model.vocab_size: 10 is smaller than the tokenizer's 2256 tokens; "
        "use -1 or a larger value"
    ], out[-3000:]
    assert "killed" not in out and "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]


def test_dead_data_worker_ends_in_one_line_then_resumes_exactly(reference, tmp_path):
    """SIGKILL of rank 1's data loading worker mid-training: the job stops at once with exit code 6 and
    rank 1's one line, which the launcher shows though LOG_RANK hides rank 1; no traceback (rank 0, cut
    off from rank 1, exits 4: the launcher reports the cause). The relaunch ends exactly like the
    reference."""
    with launched(tmp_path) as launcher:
        wait_for(lambda: chaos.complete_checkpoints(tmp_path) == ["step-2"] or launcher.poll() is not None)
        assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
        worker = data_worker(launcher.pid, 1)
        os.kill(worker, signal.SIGKILL)
        code = launcher.wait(60)
    out = (tmp_path / "launcher.log").read_text()
    assert code == EXIT_DATA, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert (
        f"[rank1]: error: rank 1: data loading worker 0 (pid {worker}) was killed by SIGKILL; launch again "
        "to resume from the last checkpoint"
    ) in out.splitlines(), out[-3000:]
    assert chaos.last_step(out) < chaos.STEPS
    chaos.run_to_end(2, tmp_path, *NO_VALIDATION)
    chaos.compare(tmp_path, reference)


def test_stalled_data_worker_times_out_in_one_line(tmp_path):
    """SIGSTOP of rank 1's data loading worker (alive, stuck): after training.data_timeout_seconds rank 1,
    not rank 0 left waiting for it in a collective, ends the job with exit code 6, and the launcher shows
    its one line though LOG_RANK hides rank 1."""
    timeout = 3
    args = ["--training.data_timeout_seconds", str(timeout), "--training.steps", "1000"]
    with launched(tmp_path, *args, "--checkpoint.enable_checkpoint", "false") as launcher:
        wait_for(lambda: trained_steps(tmp_path) >= 1 or launcher.poll() is not None)
        assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
        worker = data_worker(launcher.pid, 1)
        os.kill(worker, signal.SIGSTOP)
        start = time.monotonic()
        code = launcher.wait(60)
        elapsed = time.monotonic() - start
    out = (tmp_path / "launcher.log").read_text()
    assert code == EXIT_DATA, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert (
        f"[rank1]: error: rank 1: data loading worker 0 (pid {worker}) made no batch within "
        f"training.data_timeout_seconds = {timeout} s: it is stalled (stopped, or blocked reading its data); "
        "launch again to resume from the last checkpoint"
    ) in out.splitlines(), out[-3000:]
    assert timeout <= elapsed < chaos.COMM_TIMEOUT, out[-3000:]


def test_relaunch_right_after_the_whole_job_is_killed(tmp_path):
    """SIGKILL of a job's whole process tree (the launcher and every worker), then a relaunch at once:
    it is not refused, though the lock's holder is not reaped before it (its parent, this process,
    reaps it only after: as in a container whose PID 1 never reaps)."""
    job = [*TINY_JOB, "--job.dump_folder", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subreaper():
        launcher = subprocess.Popen(
            [str(ROOT / "run_llama_train.sh"), *job, "--training.steps", "1000"],
            env={**env, "NGPU": "2"},
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: trained_steps(tmp_path) >= 1)
        for pid in [launcher.pid, *descendants(launcher.pid)]:
            os.kill(pid, signal.SIGKILL)
        relaunch = subprocess.run(
            [str(ROOT / "run_llama_train.sh"), *job, "--training.steps", "1"],
            env={**env, "NGPU": "1"},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        launcher.wait(30)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert "Took over" in relaunch.stdout + relaunch.stderr


@pytest.mark.parametrize("fault", ["dead", "hung"])
def test_survivor_exits_within_the_timeout(tmp_path, fault):
    """Rank 1 killed (SIGKILL) or hung (SIGSTOP: alive, stuck) after step 2: rank 0 exits with code 4
    and one line naming what it waited for, within comm.train_timeout_seconds, instead of hanging."""
    timeout = 5
    job = chaos.Job(
        2,
        tmp_path,
        *chaos.JOB,
        "--training.steps",
        "1000",
        "--checkpoint.enable_checkpoint",
        "false",
        "--comm.train_timeout_seconds",
        str(timeout),
    )
    try:
        wait_for(lambda: chaos.last_step(job.output(0)) >= 2)
        job.signal([1], signal.SIGKILL if fault == "dead" else signal.SIGSTOP)
        start = time.monotonic()
        job.procs[0].wait(timeout + 60)
        elapsed = time.monotonic() - start
    finally:
        job.kill()
    out = job.output(0)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert job.procs[0].returncode == 4, out[-3000:]
    assert "Traceback" not in out and len(errors) == 1, out[-3000:]
    if fault == "dead":  # gloo notices at once that the peer's socket closed
        assert "a collective lost its connection to another rank" in errors[0]
        assert elapsed < timeout + 30
    else:
        assert errors[0] == (
            f"error: rank 0: a collective timed out after {timeout} s waiting for other ranks "
            "(comm.train_timeout_seconds); a rank may have died or hung"
        )
        assert timeout - 1 < elapsed < timeout + 30


def test_missing_rank_times_out_at_start(tmp_path):
    """Rank 1 of 2 never starts: rank 0 gives up after comm.init_timeout_seconds, in one line."""
    job = chaos.Job(1, tmp_path, *chaos.JOB, "--comm.init_timeout_seconds", "5", world_size=2)
    assert job.wait(300) == [4], job.output()[-3000:]
    errors = [line for line in job.output().splitlines() if line.startswith("error:")]
    assert errors == [
        "error: rank 0: timed out after comm.init_timeout_seconds = 5 s waiting for the other ranks to join; "
        "a rank may have failed to start: check its output"
    ]


NONFINITE_JOB = [
    *chaos.JOB[:2],
    "--training.seq_len",
    "64",
    "--training.batch_size",
    "2",
    "--training.steps",
    "3",
    "--metrics.log_freq",
    "10",
    "--checkpoint.enable_checkpoint",
    "true",
    "--checkpoint.interval",
    "1",
    "--optimizer.lr",
    "1e30",  # step 1's update makes the weights huge: every later gradient norm is NaN
    "--lr_scheduler.warmup_steps",
    "0",
    *NO_VALIDATION,  # the last step's, on the weights step 1 made huge: 10 to 50 s, and read by no assertion
]


def all_finite(path) -> bool:
    state = read_checkpoint(str(path))
    return all(
        torch.isfinite(v).all()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    )


def test_nonfinite_step_stops_before_saving(tmp_path, capsys):
    assert run_train_in_process(*NONFINITE_JOB, "--job.dump_folder", str(tmp_path)) == 3
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: step 2: the gradient norm is not finite; stopped at step 2 without saving (the checkpoints "
        "are from before it). Lower optimizer.lr, or set training.skip_nonfinite_steps to skip such steps"
    ]
    assert chaos.complete_checkpoints(tmp_path) == ["step-1"]
    assert all_finite(tmp_path / "checkpoint" / "step-1")


def test_nonfinite_steps_skipped_and_counted(tmp_path):
    args = [*NONFINITE_JOB, "--training.skip_nonfinite_steps", "true", "--job.dump_folder", str(tmp_path)]
    assert run_train_in_process(*args) == 0
    assert [(r["step"], r["skipped_steps"]) for r in read_metrics(tmp_path)] == [(1, 0), (3, 2)]
    first, last = (read_checkpoint(str(tmp_path / "checkpoint" / f"step-{s}")) for s in (1, 3))
    assert all_finite(tmp_path / "checkpoint" / "step-3")
    for key, value in first.items():  # no optimizer step after step 1: weights and moments unchanged
        if key.startswith(("model.", "optimizer.state.")):
            assert torch.equal(value, last[key]), key


def test_stop_request_without_process_group():
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        request = StopRequest()
        assert not request.agreed(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert request.agreed(torch.device("cpu")) and request.signal_name == "SIGUSR1"
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_comm_failure_messages():
    comm = CommConfig(init_timeout_seconds=300, train_timeout_seconds=10)
    gloo_timeout = RuntimeError(
        "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv"
    )
    assert comm_failure_message(gloo_timeout, 3, comm) == (
        "rank 3: a collective timed out after 10 s waiting for other ranks (comm.train_timeout_seconds); "
        "a rank may have died or hung"
    )
    init_timeout = RuntimeError("Timed out waiting 300000ms for send operation to complete")
    assert "(comm.init_timeout_seconds)" in comm_failure_message(init_timeout, 0, comm)
    reset = RuntimeError(
        "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1947: Connection reset by peer."
    )
    assert "lost its connection to another rank (Connection reset by peer)" in comm_failure_message(
        reset, 0, comm
    )
    try:  # a peer lost during a checkpoint save: DCP wraps the error (a BaseException)
        raise reset
    except RuntimeError as e:
        wrapped = dcp.CheckpointException("save", {1: _wrap_exception(e)})
    assert "lost its connection to another rank" in comm_failure_message(wrapped, 0, comm)
    assert comm_failure_message(RuntimeError("CUDA out of memory"), 0, comm) is None
    assert comm_failure_message(ValueError("Timed out waiting 5ms"), 0, comm) is None


def test_exit_process_ends_as_the_interpreter_would_with_a_thread_pool_idle():
    """train.py's exit_process runs threading's exit hooks before it joins the threads, as the interpreter
    does: an idle thread pool (torch.compile keeps one) is told to stop rather than waited for forever;
    then the exit handlers run, and the code is the job's."""
    code = (
        "import atexit, concurrent.futures\n"
        "from torchtitan.reliability.entry import exit_process\n"
        "pool = concurrent.futures.ThreadPoolExecutor(2)\n"
        "pool.submit(print, 'ran', flush=True).result()\n"
        "atexit.register(print, 'exit handler')\n"
        "exit_process(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout) == (3, "ran\nexit handler\n"), result.stderr

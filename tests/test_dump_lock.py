"""One job per dump folder: a second launch is refused in seconds while the first trains on; a lock
left by a dead job (gone, a zombie, its pid given to another process, its flock dropped) is taken over."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
from launch import ROOT, TINY_JOB, read_metrics, run_train_in_process

from torchtitan.config.options import ConfigError
from torchtitan.reliability.dump_lock import (
    LOCK_NAME,
    STALE_SECONDS,
    DumpFolderLock,
    check_unlocked,
    proc_stat,
)


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def write_lock(folder, host: str, pid: int, age: float = 0.0, **fields) -> None:
    """A lock file naming `pid` (with `fields`: pid_started, flock) whose heartbeat is `age` s old."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    path.write_text(json.dumps({"host": host, "pid": pid, "since": time.time() - age, **fields}))
    os.utime(path, (time.time() - age, time.time() - age))


def test_lock_is_exclusive_and_released(tmp_path):
    with (
        DumpFolderLock(str(tmp_path / "run")),
        pytest.raises(ConfigError, match=rf"is in use by another job \(host {socket.gethostname()}, pid"),
    ):
        DumpFolderLock(str(tmp_path / "run"))
    check_unlocked(str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # made for the lock, left empty: removed again


@pytest.mark.parametrize(
    "host, age, taken_over",
    [
        ("here", 0, True),  # a dead pid on this host (kill -9)
        ("other-node", STALE_SECONDS + 60, True),  # another host's lock without a heartbeat
        ("other-node", 10, False),  # another host's live job
    ],
)
def test_stale_lock_is_taken_over(tmp_path, host, age, taken_over):
    write_lock(tmp_path, socket.gethostname() if host == "here" else host, dead_pid(), age)
    if not taken_over:
        with pytest.raises(ConfigError, match="host other-node"):
            DumpFolderLock(str(tmp_path))
        return
    with DumpFolderLock(str(tmp_path)) as lock:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid() == lock.holder.pid


def test_zombie_holder_is_dead(tmp_path):
    """A holder that died but was not reaped (forever in a container whose PID 1 never reaps)."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while proc_stat(zombie.pid)[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        write_lock(tmp_path, socket.gethostname(), zombie.pid)
        with DumpFolderLock(str(tmp_path)):
            assert lock_holder_pid(tmp_path / LOCK_NAME) == os.getpid()
    finally:
        zombie.wait()


@pytest.mark.parametrize(
    "start_offset, flock, taken_over",
    [
        (-1, False, True),  # the holder's pid now names another process: it started at another time
        (0, True, True),  # the holder took a flock that nobody holds now: it died, whatever the pid says
        (0, False, False),  # a live holder on a file system without flock: its pid and start time match
    ],
)
def test_live_pid_is_judged_by_start_time_and_flock(tmp_path, start_offset, flock, taken_over):
    started = proc_stat(os.getpid())[1] + start_offset
    write_lock(tmp_path, socket.gethostname(), os.getpid(), pid_started=started, flock=flock)
    if not taken_over:
        with pytest.raises(ConfigError, match=rf"pid {os.getpid()}, since"):
            DumpFolderLock(str(tmp_path))
        return
    with DumpFolderLock(str(tmp_path)) as lock:
        assert json.loads((tmp_path / LOCK_NAME).read_text()) == asdict(lock.holder)
        assert lock.holder.flock  # the temporary folder's file system supports flock


def lock_holder_pid(path) -> int | None:
    """The pid named in a lock file, None until it is there and complete."""
    try:
        return json.loads(path.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


STEPS = 20


def test_second_launch_is_refused_while_the_first_trains_on(tmp_path):
    """The first job is paused (SIGSTOP: alive, holding its lock) once it has trained a step, while
    the two refused launches run, then goes on to its last step: however slow the machine, the
    refusals happen mid-training, so a few steps are enough (no race with the first job's end)."""
    dump = tmp_path / "dump"
    job = [*TINY_JOB, "--training.steps", str(STEPS), "--job.dump_folder", str(dump)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    first = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *job], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    paused = False
    try:
        deadline = time.time() + 120
        # Trained a step: metrics.jsonl (flushed at each record) holds a complete line.
        while not ((dump / "metrics.jsonl").exists() and "\n" in (dump / "metrics.jsonl").read_text()):
            assert first.poll() is None and time.time() < deadline, "the first job never trained a step"
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)
        paused = True
        assert lock_holder_pid(dump / LOCK_NAME) == first.pid
        logged = (dump / "metrics.jsonl").read_text().count("\n")
        assert logged < STEPS, "the first job ended before it was paused"
        start = time.time()
        second = subprocess.run(
            [str(ROOT / "run_llama_train.sh"), *job[2:]],
            env={**env, "NGPU": "1"},
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert time.time() - start < 30
        assert second.returncode == 2, second.stderr
        assert f"is in use by another job (host {socket.gethostname()}, pid {first.pid}" in second.stderr
        assert second.stderr.count("\n") == 1, second.stderr
        # A worker started without the preflight (torchrun train.py) is refused by rank 0's lock.
        assert run_train_in_process(*job) == 2
        assert first.poll() is None, "the refused launches disturbed the first job"
    finally:
        if paused:
            first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 0
    assert [m["step"] for m in read_metrics(dump)] == list(range(1, STEPS + 1))
    assert not (dump / LOCK_NAME).exists()

"""The [profiling] options in real runs of train.py."""

import json

from launch import TINY_JOB, run_train, run_train_in_process


def test_profiler_writes_a_chrome_trace_per_rank_and_window(tmp_path):
    result = run_train(
        2,
        tmp_path,
        "--training.steps",
        "4",
        "--profiling.enable_profiling",
        "true",
        "--profiling.profile_freq",
        "2",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    traces = tmp_path / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_2", "iteration_4"]
    for window in ("iteration_2", "iteration_4"):
        assert sorted(p.name for p in (traces / window).iterdir()) == ["rank0_trace.json", "rank1_trace.json"]
    with open(traces / "iteration_4" / "rank1_trace.json") as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name") for e in events}
    # One profiled step: the forward's matmuls, backward, the optimizer and the allocator's events.
    assert {"aten::mm", "Optimizer.step#AdamW.step", "[memory]"} <= names, sorted(names)[:50]
    assert sum(e.get("name") == "ProfilerStep#4" for e in events) == 1


def test_memory_snapshot_on_cpu_is_a_one_line_config_error(tmp_path, capsys):
    """In this process: train.py's run(), as each rank runs it (a config error's way out through torchrun
    is test_pipeline.py's test_bad_pipeline_layout_stops_train_py_with_one_line)."""
    code = run_train_in_process(
        *TINY_JOB, "--job.dump_folder", str(tmp_path), "--profiling.enable_memory_snapshot", "true"
    )
    captured = capsys.readouterr()
    assert code != 0
    lines = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    assert lines[0].startswith("error: profiling.enable_memory_snapshot: memory snapshots record the CUDA")
    assert "this run is on cpu; set it to false" in lines[0]
    assert "Training steps" not in captured.out  # stopped before building the model

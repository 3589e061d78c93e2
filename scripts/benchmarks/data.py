"""benchmark.py's data rows: the loader's tokens/s against train.py's, the tokens a rank
tokenizes at simulated DP degrees, a streaming source at scale, the pre-tokenized loader and
scripts/pretokenize.py's workers."""

import json
import time
from collections.abc import Callable
from pathlib import Path

from scripts.benchmarks.step import CLOCK, ROOT, TRAIN_ARGS
from torchtitan.config.parser import parse_args


def loader_rate(batches, seconds: float) -> dict:
    """Tokens/s (wall and CPU clocks) the iterator delivers over `seconds`."""
    count, wall, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        inputs, _ = next(batches)
        count += inputs.numel()
    return {"wall": count / (time.perf_counter() - wall), "cpu": count / (time.process_time() - cpu)}


def part_data(tmp: str, seconds: float = 5.0) -> dict:
    """Tokens/s of the loader alone, past its first batch (dataset loading)."""
    from torchtitan.datasets.build import DataSource, build_dataset
    from torchtitan.datasets.layout import BatchLayout
    from torchtitan.datasets.loader import DataLoader
    from torchtitan.datasets.tokenizer import build_tokenizer

    job_config = parse_args(TRAIN_ARGS)
    t = job_config.training
    tokenizer = build_tokenizer(ROOT / job_config.model.tokenizer_path)
    dataset = build_dataset(
        DataSource(t.dataset, t.dataset_path), tokenizer, t.seq_len, BatchLayout(t.batch_size)
    )
    batches = iter(DataLoader(dataset, t.batch_size))
    next(batches)
    return loader_rate(batches, seconds)


def part_data_sharding(tmp: str, steps: int = 200, seconds: float = 3.0) -> dict:
    """Rank 0's loader at simulated DP degrees (its loader only; the other ranks' are not built): tokens
    tokenized per token yielded over its first `steps` batches, then its tokens/s."""
    from torchtitan.datasets.build import DataSource, build_dataset
    from torchtitan.datasets.layout import BatchLayout
    from torchtitan.datasets.loader import DataLoader
    from torchtitan.datasets.tokenizer import build_tokenizer

    job_config = parse_args(TRAIN_ARGS)
    t = job_config.training
    tokenizer = build_tokenizer(ROOT / job_config.model.tokenizer_path)

    class Counting:
        count = 0

        def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
            ids = tokenizer.encode(s, bos=bos, eos=eos)
            self.count += len(ids)
            return ids

    result = {}
    for dp in (1, 8, 64):
        counting = Counting()
        layout = BatchLayout(t.batch_size, dp, 0)
        dataset = build_dataset(DataSource(t.dataset, t.dataset_path), counting, t.seq_len, layout)
        batches = iter(DataLoader(dataset, t.batch_size))
        trained = sum(next(batches)[0].numel() for _ in range(steps))
        result[dp] = {"tokenized_per_trained": counting.count / trained, **loader_rate(batches, seconds)}
    return result


def part_data_streaming(tmp: str, files: int = 256, copies: int = 16, seconds: float = 5.0) -> dict:
    """Rank 0's loader at simulated DP 1 and 64 on a local streaming source of `files` jsonl files (the
    corpus `copies` times over, its documents dealt in turn to the files), the code path of a streaming hub
    dataset such as C4: tokens/s past its first batch."""
    import datasets

    from torchtitan.datasets.loader import DataLoader
    from torchtitan.datasets.sources import load_text_dataset
    from torchtitan.datasets.text import TextDataset
    from torchtitan.datasets.tokenizer import build_tokenizer

    job_config = parse_args(TRAIN_ARGS)
    t = job_config.training
    tokenizer = build_tokenizer(ROOT / job_config.model.tokenizer_path)
    texts = list(load_text_dataset(t.dataset, t.dataset_path)["text"]) * copies
    paths = [Path(tmp, f"shard-{f:05d}.jsonl") for f in range(files)]
    for f, path in enumerate(paths):
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts[f::files]))
    result = {"files": files, "documents": len(texts)}
    for dp in (1, 64):
        ds = datasets.load_dataset("json", data_files=[str(p) for p in paths], split="train", streaming=True)
        dataset = TextDataset(t.dataset, ds, tokenizer, t.seq_len, t.batch_size, dp, 0)
        batches = iter(DataLoader(dataset, t.batch_size))
        next(batches)
        result[dp] = loader_rate(batches, seconds)
    return result


def part_pretokenized(tmp: str, seconds: float = 3.0) -> dict:
    """Pretokenize the corpus 16 times over (18M tokens: on the corpus once, 0.4 s of work, starting the
    worker processes dominates) with 1 and 2 workers, 1,024 documents per shard (tokens/s, wall time: the
    workers are other processes), then the tokens/s of rank 0's memory-mapped loader at simulated DP 8,
    in order and shuffled."""
    from torchtitan.datasets.build import DataSource, build_dataset
    from torchtitan.datasets.layout import BatchLayout
    from torchtitan.datasets.loader import DataLoader
    from torchtitan.datasets.pretokenized import pretokenize
    from torchtitan.datasets.sources import load_text_dataset
    from torchtitan.datasets.tokenizer import build_tokenizer

    job_config = parse_args(TRAIN_ARGS)
    t = job_config.training
    path = str(ROOT / job_config.model.tokenizer_path)
    tokenizer = build_tokenizer(path)
    ds = load_text_dataset(t.dataset, t.dataset_path)
    result = {}
    for workers in (1, 2):
        output = Path(tmp, f"pretokenized-{workers}")
        start = time.perf_counter()
        texts = (batch["text"] for _ in range(16) for batch in ds.iter(batch_size=1024))
        manifest = pretokenize(texts, path, tokenizer.n_words, output, workers, {"dataset": t.dataset})
        result[f"pretokenize_{workers}"] = manifest["num_tokens"] / (time.perf_counter() - start)
    for order, shuffle in (("in_order", False), ("shuffled", True)):
        source = DataSource(t.dataset, str(output), shuffle=shuffle)
        dataset = build_dataset(source, tokenizer, t.seq_len, BatchLayout(t.batch_size, 8, 0))
        batches = iter(DataLoader(dataset, t.batch_size))
        next(batches)
        result[order] = loader_rate(batches, seconds)
    return result


def data_rows(run_part: Callable[..., dict], add: Callable[..., None], trained: dict) -> None:
    """`trained`: train.py's step time and tokens per step (the overhead part's), which the loader's
    tokens/s are compared with."""
    d = run_part("data")
    consumed = trained["tokens"] / trained[CLOCK]
    ratio = d[CLOCK] / consumed
    add(
        "data pipeline",
        ratio,
        ">= 20",
        ratio >= 20,
        f"loader {d[CLOCK]:,.0f} tokens/s ({d['wall']:,.0f}), train.py consumes {consumed:,.0f}",
        d,
    )

    ds = run_part("data_sharding")
    tokenized = {dp: r["tokenized_per_trained"] for dp, r in ds.items()}
    add(
        "data tokenized",
        max(tokenized.values()),
        "<= 1.25",
        max(tokenized.values()) <= 1.25,
        "per trained token at DP " + ", ".join(f"{dp}: {v:.3f}" for dp, v in tokenized.items()),
        ds,
    )
    scale = ds["64"][CLOCK] / ds["1"][CLOCK]
    add(
        "data at scale",
        scale,
        ">= 0.8",
        scale >= 0.8,
        f"one rank's loader at DP 64 {ds['64'][CLOCK]:,.0f} tokens/s ({ds['64']['wall']:,.0f}), "
        f"at DP 1 {ds['1'][CLOCK]:,.0f} ({ds['1']['wall']:,.0f})",
        ds,
    )

    st = run_part("data_streaming")
    scale = st["64"][CLOCK] / st["1"][CLOCK]
    add(
        "streaming data at scale",
        scale,
        ">= 0.8",
        scale >= 0.8,
        f"one rank's loader at DP 64 {st['64'][CLOCK]:,.0f} tokens/s ({st['64']['wall']:,.0f}), "
        f"at DP 1 {st['1'][CLOCK]:,.0f} ({st['1']['wall']:,.0f}); {st['documents']:,} documents streamed "
        f"from {st['files']} local jsonl files",
        st,
    )

    p = run_part("pretokenized")
    rate = min(p["in_order"][CLOCK], p["shuffled"][CLOCK])
    add(
        "pre-tokenized loader",
        rate,
        ">= 5M",
        rate >= 5e6,
        f"one rank's loader {p['in_order'][CLOCK]:,.0f} tokens/s ({p['in_order']['wall']:,.0f}) in order, "
        f"{p['shuffled'][CLOCK]:,.0f} ({p['shuffled']['wall']:,.0f}) shuffled",
        p,
    )
    speedup = p["pretokenize_2"] / p["pretokenize_1"]
    add(
        "pretokenize",
        speedup,
        "> 1",
        speedup > 1,
        f"{p['pretokenize_1']:,.0f} tokens/s with 1 worker, {p['pretokenize_2']:,.0f} with 2 (wall time)",
        p,
    )

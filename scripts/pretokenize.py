"""Tokenize a job's dataset once into memory-mappable token shards, so that training tokenizes nothing.

    python scripts/pretokenize.py --job.config_file F [--training.dataset_path P | --training.dataset NAME]
        --output DIR [--workers N] [--split train] [--docs-per-shard 16384]

Reads the dataset as train.py would (`training.dataset` / `training.dataset_path`, any source the trainer
accepts) and encodes it with `model.tokenizer_path`, every document framed by BOS (if the tokenizer has
one) and EOS; with `chat.enable`, every conversation rendered with the chat template, masked by
`chat.loss_on` and fitted to `training.seq_len` by `chat.overflow` (training checks the folder was written
for its settings), its mask beside its tokens; each shard gets a CRC32 per block of tokens, which
training checks when it first reads the block. Then train with `--training.dataset_path DIR` (or
`--validation.dataset_path DIR` for a `--split validation` output).
DIR must not exist; it appears only once complete (it is written as DIR.tmp-PID, removed on any failure;
one a killed run left is removed by the next run on DIR). Exit codes and one-line errors are train.py's: a
full disk is exit 2 naming DIR and the OS error.
"""

import argparse
import contextlib
import errno
import glob
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import datasets  # noqa: E402

from torchtitan.config.options import ConfigError, JobConfig  # noqa: E402
from torchtitan.config.parser import OneLineParser, parse_args, positive_int  # noqa: E402
from torchtitan.config.paths import resolve_path  # noqa: E402
from torchtitan.datasets.chat_data import chat_encoder, load_chat_dataset  # noqa: E402
from torchtitan.datasets.chat_shards import pretokenize_chats  # noqa: E402
from torchtitan.datasets.pretokenized import pretokenize  # noqa: E402
from torchtitan.datasets.sources import load_text_dataset  # noqa: E402
from torchtitan.datasets.tokenizer import build_tokenizer  # noqa: E402
from torchtitan.errors import EXIT_OK, bad_input, run_with_exit_codes  # noqa: E402
from torchtitan.reliability.dump_lock import pid_runs  # noqa: E402

WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)  # only ever a write's


def remove_stale_temporaries(output: Path) -> None:
    """Remove the `{output}.tmp-PID` folders that killed runs left: their pid is gone, a zombie, or this
    process (a container's pids repeat across runs). A pid given to another live process keeps its
    folder until that process ends; a live run's folder is never touched."""
    for tmp in output.parent.glob(f"{glob.escape(output.name)}.tmp-*"):
        pid = tmp.name.rpartition(".tmp-")[2]
        if pid.isdigit() and (int(pid) == os.getpid() or not pid_runs(int(pid))):
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"Removed {tmp}, left by a pretokenize.py run that died (pid {pid})")


@contextlib.contextmanager
def output_write_reported(output: Path) -> Iterator[None]:
    """A failed write (a full disk, a quota, a file-size limit, a read-only folder, or any OS error on
    the temporary folder) is one line naming the output and the OS error, not the dataset option."""
    try:
        yield
    except OSError as e:
        if e.errno not in WRITE_ERRNOS and not str(e.filename or "").startswith(f"{output}.tmp-"):
            raise
        code = errno.errorcode.get(e.errno or 0, "")
        raise ConfigError(
            f"--output: cannot write {output}: {e.strerror or e} ({code}); its temporary folder is removed: "
            "free space there or choose another --output"
        ) from e


def main(argv: list[str]) -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="the folder to create")
    parser.add_argument("--workers", type=positive_int, default=os.cpu_count(), help="tokenizing processes")
    parser.add_argument("--split", default="train", help="the dataset's split (default: train)")
    parser.add_argument("--docs-per-shard", type=positive_int, default=16384, help="documents per shard file")
    own, job_argv = parser.parse_known_args(argv)
    job_config = parse_args(job_argv)
    output = Path(own.output)
    if output.exists():
        raise ConfigError(f"--output: {output} exists; pretokenize.py only creates a new folder")
    remove_stale_temporaries(output)

    training = job_config.training
    tokenizer_path = resolve_path(job_config.model.tokenizer_path)
    with bad_input("model.tokenizer_path"):
        tokenizer = build_tokenizer(tokenizer_path)
    option = "training.dataset_path" if training.dataset_path else "training.dataset"
    if job_config.chat.enable:
        manifest = pretokenize_chat_job(job_config, tokenizer, tokenizer_path, output, own)
        counts = ", ".join(f"{n} {kind}" for kind, n in manifest["chat"]["counts"].items())
        conversations = f"{manifest['num_documents']:,} conversations ({counts or 'none left out'})"
        print(f"{output}: {manifest['num_tokens']:,} tokens of {conversations}")
        return EXIT_OK
    with bad_input(option):
        ds = load_text_dataset(training.dataset, training.dataset_path, own.split)  # its cache is no --output
        source = {"dataset": training.dataset, "dataset_path": training.dataset_path, "split": own.split}
        with output_write_reported(output):
            manifest = pretokenize(
                (batch["text"] for batch in ds.iter(batch_size=own.docs_per_shard)),
                tokenizer_path,
                tokenizer.n_words,
                output,
                own.workers,
                source,
                total_documents=len(ds) if isinstance(ds, datasets.Dataset) else None,
            )
    print(
        f"{output}: {manifest['num_tokens']:,} tokens ({manifest['dtype']}) of {manifest['num_documents']:,} "
        f"documents in {len(manifest['shards'])} shards"
    )
    return EXIT_OK


def pretokenize_chat_job(
    job_config: JobConfig, tokenizer: Any, tokenizer_path: str, output: Path, own: argparse.Namespace
) -> dict[str, Any]:
    """Conversations (chat.enable) rendered, tokenized and masked as training would for its
    training.seq_len (chat_shards.py), in this process: chat sets are small beside pre-training corpora."""
    training = job_config.training
    encoder = chat_encoder(job_config.chat, tokenizer, training.seq_len)
    with bad_input("training.dataset_path" if training.dataset_path else "training.dataset"):
        ds = load_chat_dataset(training.dataset, training.dataset_path, own.split, job_config.chat.format)
        source = {"dataset": training.dataset, "dataset_path": training.dataset_path, "split": own.split}
        with output_write_reported(output):
            return pretokenize_chats(
                (batch["text"] for batch in ds.iter(batch_size=own.docs_per_shard)),
                encoder,
                tokenizer_path,
                tokenizer.n_words,
                output,
                source,
            )


def run(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_with_exit_codes(lambda: main(argv), lambda: None)


if __name__ == "__main__":
    sys.exit(run())

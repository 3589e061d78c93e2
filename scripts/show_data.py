"""Show what a job trains on: the first rows of rank 0's first batch, the tokens without loss marked.

    python scripts/show_data.py --job.config_file F [--rows N] [--nproc N] [--json] [--section.key VALUE ...]

The data are built as train.py builds them (any train.py option may be given), for the job's layout on
`--nproc` processes (the global batch decides which documents each row reads). Each row is printed as
text with the tokens that are not targets of the loss between ⟦ and ⟧ (chat data: prompts, system turns,
padding), or with --json as one line per row: {"input_ids": [...], "labels": [...], "positions": [...]}
(labels -100 where there is no loss; positions: each token's place in its document).
"""

import json
import os
import sys

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan.config.parser import OneLineParser, parse_args  # noqa: E402
from torchtitan.config.paths import resolve_path  # noqa: E402
from torchtitan.config_rules import check_layout, gradient_accumulation_steps  # noqa: E402
from torchtitan.datasets.build import build_training_data_loader  # noqa: E402
from torchtitan.datasets.layout import IGNORE_INDEX, BatchLayout  # noqa: E402
from torchtitan.datasets.tokenizer import AnyTokenizer, build_tokenizer  # noqa: E402
from torchtitan.errors import bad_input, run_with_exit_codes  # noqa: E402
from torchtitan.models import build_model_args  # noqa: E402
from torchtitan.models.documents import document_positions, find_documents  # noqa: E402


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="show_data.py",
        description="Print the first rows of rank 0's first batch of a job. Every train.py option "
        "(--section.key VALUE) is accepted too: see `python train.py --help`.",
        allow_abbrev=False,
    )
    parser.add_argument("--rows", type=int, default=2, help="rows to print (default 2)")
    parser.add_argument("--nproc", type=int, default=1, help="the job's processes (default 1)")
    parser.add_argument("--json", action="store_true", help="one JSON line per row")
    return parser


def first_batch(
    job_argv: list[str], nproc: int
) -> tuple[AnyTokenizer, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank 0's first micro-batch: input ids, labels and positions (text data: from its documents
    under block_causal, else the place in the window)."""
    job = parse_args(job_argv)
    parallel_dims = check_layout(job, nproc)
    dp_degree = parallel_dims.dp_replicate * parallel_dims.dp_shard
    layout = BatchLayout(
        job.training.batch_size, dp_degree, 0, gradient_accumulation_steps(job.training, parallel_dims)
    )
    with bad_input("model.tokenizer_path"):
        tokenizer = build_tokenizer(resolve_path(job.model.tokenizer_path))
    args = build_model_args(job, tokenizer.n_words, tokenizer.eos_id, tokenizer.bos_id)
    job.training.data_workers = 0
    loader = build_training_data_loader(job.training, tokenizer, layout, args.vocab_size, False, job.chat)
    batch = next(iter(loader))
    inputs, labels = batch.inputs, batch.labels
    if batch.positions is not None:
        return tokenizer, inputs, labels, batch.positions
    if args.attn_mask_type == "block_causal":
        return tokenizer, inputs, labels, document_positions(find_documents(inputs, args.eos_id, args.bos_id))
    return tokenizer, inputs, labels, torch.arange(inputs.shape[1]).expand_as(inputs)


LEGEND = (
    "Legend: ⟦between these marks⟧ the tokens that are no target of the loss (label -100: a document's "
    "first token, prompts, system and user turns, padding); the rest are trained on, each the target of "
    "the token before it."
)


def marked(tokenizer: AnyTokenizer, inputs: list[int], labels: list[int]) -> str:
    """The row's text, the tokens that are no target (the first one, and those whose label before them is
    -100) between ⟦ ⟧."""
    parts, masked = ["⟦", tokenizer.decode(inputs[:1])], True
    for token, label in zip(inputs[1:], labels[:-1]):
        if (label == IGNORE_INDEX) != masked:
            masked = not masked
            parts.append("⟦" if masked else "⟧")
        parts.append(tokenizer.decode([token]))
    return "".join(parts) + ("⟧" if masked else "")


def run(argv: list[str]) -> int:
    parser = build_parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    args, job_argv = parser.parse_known_args(argv)
    tokenizer, inputs, labels, positions = first_batch(job_argv, args.nproc)
    if not args.json:
        print(LEGEND)
    for row in range(min(args.rows, inputs.shape[0])):
        ids, targets, places = inputs[row].tolist(), labels[row].tolist(), positions[row].tolist()
        if args.json:
            print(json.dumps({"input_ids": ids, "labels": targets, "positions": places}))
            continue
        trained = sum(t != IGNORE_INDEX for t in targets)
        documents = sum(p == 0 for p in places)
        print(f"--- row {row}: {len(ids)} tokens, {trained} targets, {documents} documents ---")
        print(marked(tokenizer, ids, targets))
    return 0


def main(argv: list[str] | None = None) -> int:
    """The exit code (errors.py's): 2 and one line for a bad option or file."""
    return run_with_exit_codes(lambda: run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())

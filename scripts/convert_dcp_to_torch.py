"""Convert a DCP checkpoint folder into one `torch.save` file (model, optimizer, schedule, data position,
step, RNG states), e.g. to inspect it or to load it without torch.distributed:

    python scripts/convert_dcp_to_torch.py outputs/checkpoint/step-100 step-100.pt

Read it back with `torch.load("step-100.pt", weights_only=True)`. This does what
`torch.distributed.checkpoint.format_utils.dcp_to_torch_save` does, but reads the checkpoint without
unpickling anything other than plain data (torchtitan/checkpoint/safe_reader.py), as it may come from
anywhere.
"""

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, uninstalled

from torchtitan.checkpoint.folder import check_checkpoint, check_output_file_is_new  # noqa: E402
from torchtitan.checkpoint.safe_reader import SafeReader, read_checkpoint  # noqa: E402
from torchtitan.config.paths import check_output_file  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402


def convert(checkpoint: str, output: str, overwrite: bool = False) -> None:
    """Save the checkpoint's items nested as they were saved ({"model": {"norm.weight": ...}, ...}),
    into a file renamed to `output` once whole (a failed write leaves an existing one as it was)."""
    check_checkpoint("checkpoint", checkpoint)
    check_output_file("output", output)
    check_output_file_is_new("output", output, overwrite)
    paths = SafeReader(checkpoint).read_metadata().planner_data  # flattened key -> path in the nesting
    state: dict[str, Any] = {}
    for key, value in read_checkpoint(checkpoint).items():
        *parents, leaf = paths[key]
        node = state
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    partial = f"{output}.tmp-{os.getpid()}"
    try:
        torch.save(state, partial)
        os.replace(partial, output)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def main(argv: list[str] | None = None) -> int:
    """The exit code (errors.py's): 2 and one line for a bad argument or checkpoint."""
    return run_with_exit_codes(lambda: run(argv))


def run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="DCP checkpoint folder, e.g. outputs/checkpoint/step-100")
    parser.add_argument("output", help="file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    args = parser.parse_args(argv)
    convert(args.checkpoint, args.output, args.overwrite)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

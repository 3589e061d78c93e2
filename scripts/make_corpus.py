"""Regenerate the bundled training corpus: the King James Bible, one document per chapter.

The text comes from Debian's public-domain ``bible-kjv`` package (``apt-get install -y bible-kjv``).
Verse numbers are dropped so the documents read as plain English: each document is the chapter
heading ("Genesis 1"), a blank line, then one verse per line. Every ``--holdout-every``-th chapter goes
to ``validation.jsonl`` instead of ``train.jsonl``, so the split is deterministic.

Usage: python scripts/make_corpus.py [--out-dir assets/corpus/kjv] [--holdout-every 50]
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from torchtitan.config.options import ConfigError  # noqa: E402
from torchtitan.config.parser import OneLineParser, positive_int  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402

# Genesis 1:1 to Revelation 22:21; -l/-m lift the default line and verse limits of the `bible` CLI.
BIBLE_CMD = ["bible", "-l", "100000", "-m", "8192", "Gen1:1-Rev22:21"]
EXPECTED_CHAPTERS = 1189

# "Genesis 1", "1 Samuel 3", "Song of Solomon 8"
_HEADING = re.compile(r"^(?:[1-3] )?[A-Z][A-Za-z ]+ \d+$")
# "  12 And God said, ..."
_VERSE = re.compile(r"^\s*\d+ (.+)$")


def read_bible_text() -> str:
    """Print the whole KJV with the `bible` CLI and return its output."""
    if shutil.which("bible") is None:
        raise ConfigError(
            "`bible` not found: install Debian's bible-kjv package (apt-get install -y bible-kjv)"
        )
    return subprocess.run(BIBLE_CMD, check=True, capture_output=True, text=True).stdout


def split_chapters(text: str) -> list[str]:
    """Turn the CLI output into one cleaned document per chapter."""
    chapters: list[tuple[str, list[str]]] = []
    for raw_line in text.splitlines():
        line = raw_line.rstrip()
        if not line:
            continue
        if _HEADING.match(line):
            chapters.append((line, []))
            continue
        verse = _VERSE.match(line)
        if verse is None or not chapters:
            raise ValueError(f"unexpected line in `bible` output: {line!r}")
        chapters[-1][1].append(" ".join(verse.group(1).split()))
    return [heading + "\n\n" + "\n".join(verses) for heading, verses in chapters]


def write_jsonl(path: Path, docs: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")


def main() -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "assets" / "corpus" / "kjv")
    parser.add_argument(
        "--holdout-every", type=positive_int, default=50, help="every N-th chapter goes to validation"
    )
    args = parser.parse_args()

    docs = split_chapters(read_bible_text())
    if len(docs) != EXPECTED_CHAPTERS:
        raise SystemExit(f"expected {EXPECTED_CHAPTERS} chapters, got {len(docs)}: is bible-kjv complete?")
    # 1-based: chapters 50, 100, ... are held out.
    train = [d for i, d in enumerate(docs, 1) if i % args.holdout_every != 0]
    validation = [d for i, d in enumerate(docs, 1) if i % args.holdout_every == 0]
    write_jsonl(args.out_dir / "train.jsonl", train)
    write_jsonl(args.out_dir / "validation.jsonl", validation)
    n_chars = sum(len(d) for d in docs)
    print(f"wrote {len(train)} train + {len(validation)} validation chapters ({n_chars:,} chars)")
    return 0


if __name__ == "__main__":
    sys.exit(run_with_exit_codes(main))

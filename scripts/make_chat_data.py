"""Regenerate the bundled chat set: a few dozen multi-turn conversations made offline from the bundled
King James Bible (assets/corpus/kjv), so that a chat recipe (train_configs/qwen3_chat_debug.toml) runs
without the hub. Each conversation has a system prompt and asks for a chapter's verses, one turn at a
time; the assistant answers with the verse. Deterministic: the same corpus gives the same file.

Usage: python scripts/make_chat_data.py [--out assets/corpus/kjv_chat/train.jsonl] [--conversations 48]
       python scripts/make_chat_data.py --split validation   (from the corpus's held-out chapters)
"""

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You recite the King James Bible, one verse at a time."
FOLLOW_UPS = ("And the next verse?", "Go on.", "What comes after that?")


def conversation(chapter: str, turns: int) -> dict[str, list[dict[str, str]]]:
    """`turns` exchanges over the first verses of a chapter (its heading, a blank line, a verse a line)."""
    heading, _, body = chapter.partition("\n\n")
    verses = body.splitlines()[:turns]
    messages = [{"role": "system", "content": SYSTEM}]
    for i, verse in enumerate(verses):
        ask = f"Recite the first verse of {heading}." if i == 0 else FOLLOW_UPS[i % len(FOLLOW_UPS)]
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": verse}]
    return {"messages": messages}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default="train", choices=("train", "validation"))
    parser.add_argument("--corpus", help="default: assets/corpus/kjv/SPLIT.jsonl")
    parser.add_argument("--out", help="default: assets/corpus/kjv_chat/SPLIT.jsonl")
    parser.add_argument("--conversations", type=int, help="default: 48 (train), 16 (validation)")
    args = parser.parse_args(argv)
    args.corpus = args.corpus or str(REPO_ROOT / f"assets/corpus/kjv/{args.split}.jsonl")
    args.out = args.out or str(REPO_ROOT / f"assets/corpus/kjv_chat/{args.split}.jsonl")
    args.conversations = args.conversations or (48 if args.split == "train" else 16)
    with open(args.corpus) as f:
        chapters = [json.loads(line)["text"] for line in f]
    step = max(1, len(chapters) // args.conversations)
    rows = [conversation(chapters[i * step], 1 + i % 3) for i in range(args.conversations)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} conversations -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

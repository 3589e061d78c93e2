"""The named datasets (`training.dataset`, `validation.dataset`, mixture sources). Torch-free, so that the
preflight can tell a name from a path before any worker starts."""

from dataclasses import dataclass


@dataclass(frozen=True)
class DatasetSpec:
    """Where a named dataset lives and how to read it."""

    path: str  # hub id, or a folder/file relative to the repository root when `local`
    local: bool = False
    config: str | None = None  # hub config name, e.g. "en" for C4
    split: str | None = None  # pins the split (validation aliases); None uses the caller's split
    streaming: bool = False
    text_field: str = "text"


DATASETS: dict[str, DatasetSpec] = {
    "kjv": DatasetSpec(path="assets/corpus/kjv", local=True),
    "kjv_validation": DatasetSpec(path="assets/corpus/kjv", local=True, split="validation"),
    # Conversations (chat.enable): scripts/make_chat_data.py makes them from the corpus above.
    "kjv_chat": DatasetSpec(path="assets/corpus/kjv_chat", local=True),
    "c4": DatasetSpec(path="allenai/c4", config="en", streaming=True),
}

"""Where a path option is looked for, and the rules every path a user gives must pass (the job's path
options and the scripts' arguments), in one place, so that a bad path is one line naming the option and
the path as given, before anything is read or written. Torch-free.

The type of a path is taken from os.stat, never by opening it: opening a FIFO blocks until a writer
comes. Paths with spaces or any Unicode characters are fine; a NUL character is not."""

import codecs
import json
import os
import stat
import tempfile

from torchtitan.config.options import ConfigError

# Bytes of a text file decoded to tell UTF-8 from binary: enough for any header, cheap on a huge corpus.
TEXT_SAMPLE_BYTES = 1 << 20

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def path_candidates(path: str) -> list[str]:
    """Where a path option is looked for: as given (absolute, or from the current folder), then, when
    relative, from the repository root (for the bundled assets)."""
    return [path] if os.path.isabs(path) else [path, os.path.join(REPO_ROOT, path)]


def resolve_path(path: str) -> str:
    """The first of `path_candidates` that exists, else the last."""
    candidates = path_candidates(path)
    return next((c for c in candidates if os.path.exists(c)), candidates[-1])


def shown(text: str) -> str:
    """A user's text (a path, an option's name) as given, or its repr where a newline or control
    character would break the one line."""
    return text if text.isprintable() else repr(text)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a file"
    return "a FIFO" if stat.S_ISFIFO(mode) else "a socket or device"


def _check_not_dangling(option: str, path: str, resolved: str) -> None:
    if os.path.islink(resolved) and not os.path.exists(resolved):
        target = shown(os.readlink(resolved))
        raise ConfigError(f"{option}: {shown(path)} is a symlink to {target}, which is missing")


def _stat(option: str, path: str, resolved: str, missing: str) -> os.stat_result:
    """os.stat of `resolved` (`path` as found), or one line saying why there is nothing there."""
    if "\0" in path:
        raise ConfigError(f"{option}: {shown(path)} contains a NUL character; give a real path")
    try:
        return os.stat(resolved)
    except FileNotFoundError:
        _check_not_dangling(option, path, resolved)
        raise ConfigError(f"{option}: {missing}") from None
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {shown(path)} ({e.strerror})") from None


def check_file(
    option: str,
    path: str,
    resolved: str | None = None,
    text: bool = False,
    fix: str = "",
    allow_empty: bool = False,
) -> None:
    """`path` (found at `resolved`, by default as given) must be a regular file, with something in it
    unless `allow_empty`; with `text`, its first TEXT_SAMPLE_BYTES must be UTF-8. `fix` says what to
    give instead."""
    resolved = path if resolved is None else resolved
    fix = fix or f"set {option} to an existing file"
    mode = _stat(option, path, resolved, f"no such file {shown(path)}; {fix}").st_mode
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{option}: {shown(path)} is {_kind(mode)}, not a file; {fix}")
    try:
        with open(resolved, "rb") as f:
            sample = f.read(TEXT_SAMPLE_BYTES if text else 1)
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {shown(path)} ({e.strerror})") from None
    if not sample and not allow_empty:
        raise ConfigError(f"{option}: {shown(path)} is empty; set {option} to a complete file")
    if text:
        try:
            codecs.getincrementaldecoder("utf-8")().decode(sample, final=False)
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{option}: {shown(path)} is not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None


def check_folder(option: str, path: str, resolved: str | None = None, fix: str = "") -> None:
    """`path` (found at `resolved`, by default as given) must be an existing folder."""
    resolved = path if resolved is None else resolved
    fix = fix or f"set {option} to an existing folder"
    mode = _stat(option, path, resolved, f"no such folder {shown(path)}; {fix}").st_mode
    if not stat.S_ISDIR(mode):
        raise ConfigError(f"{option}: {shown(path)} is {_kind(mode)}, not a folder; {fix}")


def read_json(option: str, path: str) -> object:
    """A JSON file a user gives (a model folder's config.json, its index): its absence or damage (one
    stray comma of a hand edit) is one line naming the file."""
    check_file(option, path, text=True)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:  # malformed, or not UTF-8 past the part check_file reads
        raise ConfigError(
            f"{option}: {shown(path)} is not valid JSON ({e}); fix it or download it again"
        ) from None


def check_dataset_path(option: str, path: str, resolved: str) -> None:
    """A data file (UTF-8 unless parquet or compressed) or a folder holding files."""
    fix = "set it to a .txt/.json/.jsonl/.parquet file or a folder"
    missing = (
        f"{shown(path)} does not exist (relative paths are tried from the current folder, then from the "
        f"repository); {fix}"
    )
    mode = _stat(option, path, resolved, missing).st_mode
    if stat.S_ISDIR(mode):
        if not any(files for _, _, files in os.walk(resolved)):
            raise ConfigError(f"{option}: the folder {shown(path)} holds no files; point it at your data")
        return
    text = path.lower().endswith((".txt", ".json", ".jsonl"))
    check_file(option, path, resolved, text=text, fix=fix)


def check_writable_folder(option: str, folder: str) -> None:
    """The folder, or the nearest existing folder above it, must take a new file (tried for real:
    permission bits do not tell for root or on a read-only mount)."""
    if "\0" in folder:
        raise ConfigError(f"{option}: {shown(folder)} contains a NUL character; give a real path")
    existing = os.path.abspath(folder)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    inside = "" if existing == os.path.abspath(folder) else f" (it is inside {shown(existing)})"
    if not os.path.isdir(existing):
        _check_not_dangling(option, existing if inside else folder, existing)
        what = _kind(os.stat(existing).st_mode)
        raise ConfigError(f"{option}: {shown(folder)} is {what}, not a folder{inside}; give a folder")
    try:
        with tempfile.TemporaryDirectory(prefix=".titan-write-test-", dir=existing):
            pass
    except OSError as e:
        where = shown(folder) + (f" (its parent {shown(existing)} is not writable)" if inside else "")
        raise ConfigError(
            f"{option}: cannot write in {where} ({e.strerror}); set {option} to a writable folder"
        ) from None


def check_output_file(option: str, path: str) -> None:
    """A file to write: absent or a regular file (never a folder, a FIFO or a dangling symlink), in a
    writable folder that exists."""
    if os.path.lexists(path):
        mode = _stat(option, path, path, "").st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(
                f"{option}: {shown(path)} is {_kind(mode)}, not a file; give a file name to write"
            )
    parent = os.path.dirname(path) or "."
    check_folder(option, parent, fix=f"create it first, or give {option} in an existing folder")
    check_writable_folder(option, parent)

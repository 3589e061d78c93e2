"""Reading a job's options: the TOML file (`--job.config_file`), then the command-line overrides, each
checked against its declaration in torchtitan/config/options.py; `--help` lists them all.

Precedence: command line > TOML file > declared default.
"""

import argparse
import difflib
import functools
import math
import re
import sys
import textwrap
import types
import typing
from dataclasses import fields
from typing import Any, Union

from torchtitan.config.options import ConfigError, JobConfig, default_of
from torchtitan.config.paths import check_file, shown
from torchtitan.logging import logger

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib


def _sections() -> dict[str, type]:
    return {s.name: s.type for s in fields(JobConfig)}


def _base_type(tp: Any) -> tuple[type, bool]:
    """(the concrete type, whether None is allowed) for `int`, `str | None` and the like."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _list_item_type(tp: Any) -> type | None:
    """The item type of a `list[...]` option, None for a scalar one."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else None


def _type_name(tp: Any) -> str:
    base, optional = _base_type(tp)
    name = str(base) if _list_item_type(base) else base.__name__
    return name + (" (optional)" if optional else "")


def _closest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1)
    return f"; did you mean '{match[0]}'?" if match else f"; valid: {', '.join(candidates)}"


def _check_value(key: str, value: Any, tp: Any, meta: dict) -> Any:
    """Check a TOML value (already typed) against the declaration; ints are accepted for floats."""
    base, optional = _base_type(tp)
    if value is None and optional:
        return None
    item_type = _list_item_type(base)
    if item_type is not None:
        if not isinstance(value, list) or not all(isinstance(v, item_type) for v in value):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        for v in value:
            if meta["choices"] is not None and v not in meta["choices"]:
                raise ConfigError(f"{key}: {v!r} is not one of {', '.join(map(str, meta['choices']))}")
        return value
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if base is float and not math.isfinite(value):
        raise ConfigError(f"{key}: {value!r} is not a finite number")
    if base is int and not -(2**63) <= value < 2**63:  # TOML's range; beyond it arithmetic overflows floats
        raise ConfigError(f"{key}: {value} does not fit in 64 bits")
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, meta['choices']))}")
    if meta["min"] is not None and value < meta["min"]:
        raise ConfigError(f"{key}: {value!r} is below the minimum {meta['min']}")
    return value


def _parse_cli_value(key: str, text: str, tp: Any) -> Any:
    base, optional = _base_type(tp)
    if optional and text.lower() in ("none", "null", ""):
        return None
    if base is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"--{key}: expected true or false, got {text!r}")
    item_type = _list_item_type(base)
    if item_type is not None:  # comma-separated; an empty string is the empty list
        return [item_type(item.strip()) for item in text.split(",") if item.strip()]
    try:
        return base(text)
    except ValueError:
        raise ConfigError(f"--{key}: expected {base.__name__}, got {text!r}") from None


@functools.cache
def _option_table() -> dict[str, tuple[str, str, Any, dict]]:
    """'section.key' -> (section, key, type, metadata) for every declared option. Built once a process
    (as are the renames and the argparse parser; nothing changes them): parse_args used ~30 ms on them."""
    hints = {name: typing.get_type_hints(cls) for name, cls in _sections().items()}
    return {
        f"{sec}.{f.name}": (sec, f.name, hints[sec][f.name], f.metadata)
        for sec, cls in _sections().items()
        for f in fields(cls)
    }


@functools.cache
def _renames() -> dict[str, str]:
    """'section.old_name' -> 'section.name' for every option renamed (its declaration's `old_names`)."""
    return {
        f"{sec}.{old}": key for key, (sec, _, _, meta) in _option_table().items() for old in meta["old_names"]
    }


_NOTICED: set[str] = set()


def _new_name(key: str, renames: dict[str, str], given: set[str], where: str, dashes: str = "") -> str:
    """The option's name now: a former name is still read, with a deprecation notice (once a process);
    given with its new name as well, it is an error (which one should win is not for us to guess)."""
    if key not in renames:
        return key
    old, new = dashes + key, dashes + renames[key]
    if renames[key] in given:
        raise ConfigError(f"{old} and {new} both given {where}: {old} is {new}'s old name; keep only {new}")
    if key not in _NOTICED:
        _NOTICED.add(key)
        logger.warning(f"{old} is deprecated: use {new} (same meaning)")
    return renames[key]


# A negative number in any notation Python reads (-5, -.5, -1e-4, -1E+3, -inf): argparse's own pattern
# (-5, -.5) leaves the others to be read as options ("--optimizer.lr -1e-4": expected one argument).
NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|-(inf|infinity|nan)", re.IGNORECASE)


class OneLineParser(argparse.ArgumentParser):
    """argparse under the one-line contract (train.py's options and every script's own): a bad
    argument is a ConfigError, which errors.run_with_exit_codes reports in one line with exit code 2,
    not argparse's usage block. A negative number is a value, whatever its notation."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse (3.11 to 3.14) tells a negative number from an option by this matcher alone.
        self._negative_number_matcher = _FullMatch(NEGATIVE_NUMBER)

    def error(self, message: str) -> typing.NoReturn:
        # One line, even for an argument with a newline.
        raise ConfigError(f"{' '.join(message.split())}; see {self.prog} --help")


class _FullMatch:
    """A pattern whose `match` is its `fullmatch`, as argparse calls it."""

    def __init__(self, pattern: re.Pattern) -> None:
        self.match = pattern.fullmatch


def positive_int(value: str) -> int:
    """An argparse type for the scripts' counts: OneLineParser names the argument in the error."""
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return int(value)


@functools.cache
def _build_arg_parser() -> OneLineParser:
    table = _option_table()
    families = ", ".join(table["model.name"][3]["choices"])
    parser = OneLineParser(
        prog="train.py",
        usage="train.py [--job.config_file FILE] [--section.key VALUE | --section.key=VALUE ...]",
        description=textwrap.fill(
            f"Train a language model of one of the families {families} (model.name), from scratch or "
            "from a checkpoint, on any layout. Options come from the TOML file given by --job.config_file "
            "(a recipe in train_configs/), overridden by any --section.key VALUE given here.",
            100,
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    for sec, cls in _sections().items():
        group = parser.add_argument_group(f"[{sec}]")
        for f in fields(cls):
            _, _, tp, meta = table[f"{sec}.{f.name}"]
            extra = f"; one of {', '.join(map(str, meta['choices']))}" if meta["choices"] else ""
            extra += "".join(f"; formerly --{sec}.{old}, still read" for old in meta["old_names"])
            group.add_argument(
                f"--{sec}.{f.name}",
                dest=f"{sec}.{f.name}",
                metavar=_type_name(tp).split()[0].upper(),
                default=argparse.SUPPRESS,
                help=f"{meta['help']} ({_type_name(tp)}, default: {default_of(f)!r}{extra})",
            )
    return parser


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from the command line (and the TOML file it names)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _build_arg_parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        raise SystemExit(0)
    table = _option_table()
    argv = _with_new_names(argv)
    for arg in argv:
        if arg.startswith("--") and arg[2:].split("=", 1)[0] not in table:
            name = arg[2:].split("=", 1)[0]
            raise ConfigError(f"unknown option --{shown(name)}{_closest(name, list(table))}")
    overrides = vars(parser.parse_args(argv))
    config_file = overrides.pop("job.config_file", None)
    toml_data = _toml_with_new_names(load_toml(config_file)) if config_file else {}
    config = from_dict(toml_data)
    config.job.config_file = config_file
    in_file = {f"{sec}.{name}" for sec, values in toml_data.items() for name in values}
    config.explicit = frozenset(in_file | set(overrides))
    for key, text in overrides.items():
        sec, name, tp, meta = table[key]
        value = _check_value(f"--{key}", _parse_cli_value(key, text, tp), tp, meta)
        setattr(getattr(config, sec), name, value)
    return config


def _with_new_names(argv: list[str]) -> list[str]:
    """The command line with each option given by a former name given by its new one."""
    renames = _renames()
    given = {arg[2:].split("=", 1)[0] for arg in argv if arg.startswith("--")}

    def renamed(arg: str) -> str:
        if not arg.startswith("--"):
            return arg
        name, eq, value = arg[2:].partition("=")
        return f"--{_new_name(name, renames, given, 'on the command line', '--')}{eq}{value}"

    return [renamed(arg) for arg in argv]


def _toml_with_new_names(data: dict[str, Any]) -> dict[str, Any]:
    """The TOML file's tables with each option set by a former name set by its new one."""
    renames = _renames()
    renamed: dict[str, Any] = {}
    for sec, values in data.items():
        if not isinstance(values, dict):  # from_dict refuses it
            renamed[sec] = values
            continue
        given = {f"{sec}.{name}" for name in values}
        renamed[sec] = {
            _new_name(f"{sec}.{name}", renames, given, "in job.config_file").split(".", 1)[1]: value
            for name, value in values.items()
        }
    return renamed


def load_toml(path: str) -> dict[str, Any]:
    fix = "give a TOML file, e.g. a recipe in train_configs/"
    check_file("job.config_file", path, text=True, fix=fix, allow_empty=True)
    what = f"job.config_file: {shown(path)}"
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except UnicodeDecodeError as e:  # past the part check_file reads
        raise ConfigError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:  # TOMLDecodeError, or an integer of more than 4300 digits
        raise ConfigError(f"{what} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{what} is not valid TOML: arrays or tables nested too deeply") from None
    except OSError as e:
        raise ConfigError(f"{what}: cannot read it ({e.strerror})") from None


def from_dict(data: dict[str, Any]) -> JobConfig:
    """A JobConfig from a TOML-shaped dict; unknown sections or keys and wrong types are errors."""
    config = JobConfig()
    table = _option_table()
    sections = _sections()
    for sec, values in data.items():
        if sec not in sections:
            raise ConfigError(f"unknown TOML section [{shown(sec)}]{_closest(sec, list(sections))}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{sec}] must be a table, got {type(values).__name__}")
        for name, value in values.items():
            key = f"{sec}.{name}"
            if key not in table:
                keys = [k.split(".", 1)[1] for k in table if k.startswith(sec + ".")]
                raise ConfigError(f"unknown option {shown(name)!r} in [{sec}]{_closest(name, keys)}")
            _, _, tp, meta = table[key]
            setattr(getattr(config, sec), name, _check_value(key, value, tp, meta))
    return config

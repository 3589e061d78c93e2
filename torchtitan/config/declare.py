"""How an option is declared (`opt`: its default, help, choices and minimum) and `ConfigError`, the error
of a bad option: what options.py and the sections kept in modules of their own stand on. Torch-free."""

from dataclasses import MISSING, Field, field
from typing import Any


class ConfigError(ValueError):
    """A bad option, file or value; the message names the option and the fix."""


def opt(
    default: Any,
    help: str,
    choices: tuple | None = None,
    min: float | None = None,
    old_names: tuple[str, ...] = (),
) -> Any:
    """Declare one option: its default, help text and the values it accepts (each item's, for a list).
    `old_names`: the option's former names in its section, still read (recipes and command lines
    already written) with a deprecation notice naming the new one."""
    metadata = {"help": help, "choices": choices, "min": min, "old_names": old_names}
    if isinstance(default, list):  # each config gets its own list
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def default_of(option: Field) -> Any:
    """The declared default of an option."""
    return option.default_factory() if option.default is MISSING else option.default

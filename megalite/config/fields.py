"""How a configuration field declares itself: ``flag(...)`` for a field that a Megatron command-line flag
sets (its name, type, choices and help: megatron_cli.py builds the parser from them), ``derived(...)`` for
one computed from other inputs (saying from what)."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Callable, Optional

FLAG, DERIVED = "megatron_flag", "derived"
FIELD_DEFAULT = object()       # Flag.cli_default: the parser's default is the field's own


@dataclass(frozen=True)
class Flag:
    """How one field appears on Megatron's command line. A bool field is a switch: ``--x`` sets a
    False default, ``--no-x`` / ``--disable-x`` clears a True one."""
    name: str
    type: Optional[Callable] = None
    help: Optional[str] = None
    choices: Optional[tuple] = None
    nargs: Optional[str] = None
    cli_default: object = FIELD_DEFAULT      # None: absent means "not given" (a default is derived)


def flag(name: str, type: Optional[Callable] = None, *, default=MISSING, factory=MISSING, help: str | None = None,
         choices: tuple | None = None, nargs: str | None = None, cli_default=FIELD_DEFAULT):
    meta = {FLAG: Flag(name, type, help, choices, nargs, cli_default)}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def derived(reason: str, default=MISSING, factory=MISSING):
    """A field no flag sets directly: ``reason`` says what it is computed from."""
    if factory is not MISSING:
        return field(default_factory=factory, metadata={DERIVED: reason})
    return field(default=default, metadata={DERIVED: reason})

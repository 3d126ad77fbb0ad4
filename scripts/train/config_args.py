"""One command-line path for the scripts' frozen config dataclasses: a flag per field."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def parse_config(cls: type[T], doc: str | None, argv: list[str] | None = None) -> T:
    """``cls`` built from ``--field-name VALUE`` flags, each defaulting to the field's default.

    The flag's type is the default's (Path for paths); booleans get ``--x`` / ``--no-x``.
    """
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    for name, value in asdict(cls()).items():  # type: ignore[call-overload]
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            kind: Any = Path if isinstance(value, Path) else type(value)
            parser.add_argument(flag, type=kind, default=value)
    return cls(**vars(parser.parse_args(argv)))

"""How a `llmgw ctl` command is declared: its name, its help and the function that runs it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def command(
    sub: Any,
    name: str,
    help: str,
    description: str | None = None,
    *,
    run: Callable[[Any, argparse.Namespace], None] | None = None,
) -> argparse.ArgumentParser:
    """The parser of `name` under `sub`, run by `run` (a group of commands has none). A
    description with line breaks of its own, like the *_HELP texts with their indented lists,
    is printed as written; argparse wraps any other to the terminal's width."""
    laid_out = description is not None and "\n" in description
    parser = sub.add_parser(
        name,
        help=help,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter
        if laid_out
        else argparse.HelpFormatter,
    )
    if run is not None:
        parser.set_defaults(run=run)
    return parser

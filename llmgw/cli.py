"""Entry point of the `llmgw` command."""

from __future__ import annotations

import argparse
import sys

from . import ctl, demo
from .node import cli as node


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw", description="llmgw: self-hosted LLM serving.")
    sub = parser.add_subparsers(dest="tool", required=True, metavar="TOOL")
    ctl.add_parser(sub)
    node.add_parser(sub)
    demo.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tool == "ctl":
        return ctl.run(args)
    if args.tool == "node":
        return node.run(args)
    if args.tool == "demo":
        return demo.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Render `naiad serve`'s flag table from its argument parser into README.md (between the flags markers), or with
--check fail when the README's table differs from the parser, so `--help` and the README cannot drift apart."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- flags:begin (tools/readme_flags.py) -->", "<!-- flags:end -->"


def serve_parser() -> argparse.ArgumentParser:
    sys.path.insert(0, str(ROOT / "server"))
    from naiad.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _default(action: argparse.Action) -> str:
    if action.default in (None, [], "", argparse.SUPPRESS) or isinstance(action, argparse._StoreTrueAction):
        return ""
    return f"`{action.default}`"


def render() -> str:
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in serve_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.choices:
            names += " " + "\\|".join(str(c) for c in action.choices)
        text = (action.help or "").replace("|", "\\|").replace("\n", " ")
        if isinstance(action, argparse._AppendAction) and "repeatable" not in text:
            text = (text + " (repeatable)").strip()
        rows.append(f"| {names} | {_default(action)} | {text} |")
    return "\n".join(rows)


def main() -> int:
    readme = ROOT / "README.md"
    text = readme.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    wanted = "\n" + render() + "\n"
    if "--check" in sys.argv[1:]:
        if text[start:end] != wanted:
            print(
                "README.md's flag table differs from `naiad serve --help`: run python tools/readme_flags.py"
            )
            return 1
        return 0
    readme.write_text(text[:start] + wanted + text[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main())

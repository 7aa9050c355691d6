"""Grammars llama.cpp would recurse on without end, refused before they reach it: a repetition of something that can
match nothing (`("a"*)*`, `("a"?)+`, `("" | "a")*`) or a rule that can start with itself after parts that can match
nothing (`x ::= y x | "a"`, `y ::= ""?`). llama.cpp's grammar sampler follows such a grammar's alternatives
depth-first when it is set up, and crashes the whole process (stack overflow); its own check catches only a rule
that starts with itself directly. A grammar this reader cannot read is left to llama.cpp's parser, which refuses
malformed text without crashing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...errors import InvalidArgument

_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<define>::=)
  | (?P<name>[A-Za-z0-9_-]+)
  | (?P<literal>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<count>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[|()*+?.])
    """,
    re.VERBOSE | re.DOTALL,
)


class _Unreadable(Exception):
    """Syntax this reader does not follow: llama.cpp's own parser decides."""


@dataclass
class _Item:
    kind: str  # "literal" (text nonempty or not), "char" (one character), "ref", "group"
    empty: bool = False  # a literal "" (matches nothing)
    name: str = ""
    group: list[list[_Item]] = field(default_factory=list)
    low: int = 1  # repetition bounds: 1..1 plain, 0..None for *, ...
    high: int | None = 1


def check(grammar: str) -> None:
    """InvalidArgument when llama.cpp would recurse on `grammar` without end (see the module docstring)."""
    try:
        rules = _parse(grammar)
        nullable = _nullable(rules)
        for name, alternatives in rules.items():
            _check_repetitions(name, alternatives, rules, nullable)
        cycle = _left_recursion(rules, nullable)
    except _Unreadable:
        return
    except RecursionError:
        raise InvalidArgument("structured_outputs: the grammar nests too deeply") from None
    if cycle is not None:
        raise InvalidArgument(
            "structured_outputs: the grammar's rule '"
            + cycle
            + "' can start with itself after parts that match nothing (left recursion), which llama.cpp cannot follow"
        )


def _parse(text: str) -> dict[str, list[list[_Item]]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _Unreadable(text[pos : pos + 10])
        pos = m.end()
        if m.lastgroup != "space":
            tokens.append((m.lastgroup or "", m.group()))
    rules: dict[str, list[list[_Item]]] = {}
    i = 0
    while i < len(tokens):
        if i + 1 >= len(tokens) or tokens[i][0] != "name" or tokens[i + 1][0] != "define":
            raise _Unreadable(tokens[i][1])
        name = tokens[i][1]
        end = i + 2
        while end < len(tokens) and not (
            tokens[end][0] == "name" and end + 1 < len(tokens) and tokens[end + 1][0] == "define"
        ):
            end += 1
        body, used = _alternatives(tokens, i + 2, end)
        if used != end:
            raise _Unreadable(name)
        rules[name] = body
        i = end
    return rules


def _alternatives(tokens: list[tuple[str, str]], i: int, end: int) -> tuple[list[list[_Item]], int]:
    alternatives: list[list[_Item]] = [[]]
    while i < end:
        kind, value = tokens[i]
        if kind == "op" and value == "|":
            alternatives.append([])
            i += 1
            continue
        if kind == "op" and value == ")":
            break
        if kind == "literal":
            item = _Item("literal", empty=value == '""')
        elif kind == "cls" or (kind == "op" and value == "."):
            item = _Item("char")
        elif kind == "name":
            item = _Item("ref", name=value)
        elif kind == "op" and value == "(":
            inner, j = _alternatives(tokens, i + 1, end)
            if j >= end or tokens[j] != ("op", ")"):
                raise _Unreadable("(")
            item = _Item("group", group=inner)
            i = j
        else:
            raise _Unreadable(value)
        i += 1
        if i < end and tokens[i][0] == "count":
            low, comma, high = tokens[i][1].strip("{} ").partition(",")
            item.low = int(low)
            item.high = item.low if not comma else (int(high) if high.strip() else None)
            i += 1
        elif i < end and tokens[i] in (("op", "*"), ("op", "+"), ("op", "?")):
            item.low, item.high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[tokens[i][1]]
            i += 1
        alternatives[-1].append(item)
    return alternatives, i


def _atom_nullable(item: _Item, nullable: set[str]) -> bool:
    if item.kind == "literal":
        return item.empty
    if item.kind == "ref":
        return item.name in nullable
    if item.kind == "group":
        return any(all(_item_nullable(x, nullable) for x in alt) for alt in item.group)
    return False


def _item_nullable(item: _Item, nullable: set[str]) -> bool:
    return item.low == 0 or _atom_nullable(item, nullable)


def _nullable(rules: dict[str, list[list[_Item]]]) -> set[str]:
    nullable: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alternatives in rules.items():
            if name not in nullable and any(
                all(_item_nullable(x, nullable) for x in alt) for alt in alternatives
            ):
                nullable.add(name)
                changed = True
    return nullable


def _check_repetitions(rule: str, alternatives: list[list[_Item]], rules: dict, nullable: set[str]) -> None:
    for alt in alternatives:
        for item in alt:
            repeated = item.high is None or item.high > 1
            if repeated and _atom_nullable(item, nullable):
                raise InvalidArgument(
                    f"structured_outputs: the grammar repeats something that can match nothing (in rule '{rule}', "
                    'like ("a"*)* or ("a"?)+), which llama.cpp cannot follow: make the repeated part match at least '
                    "one character"
                )
            if item.kind == "group":
                _check_repetitions(rule, item.group, rules, nullable)


def _starts(alternatives: list[list[_Item]], nullable: set[str], out: set[str]) -> None:
    """The rules an expression can start with (after nothing but parts that can match nothing)."""
    for alt in alternatives:
        for item in alt:
            if item.kind == "ref":
                out.add(item.name)
            elif item.kind == "group":
                _starts(item.group, nullable, out)
            if not _item_nullable(item, nullable):
                break


def _left_recursion(rules: dict[str, list[list[_Item]]], nullable: set[str]) -> str | None:
    edges = {}
    for name, alternatives in rules.items():
        starts: set[str] = set()
        _starts(alternatives, nullable, starts)
        edges[name] = starts & set(rules)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str) -> str | None:
        state[node] = 1
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                return nxt
            if nxt not in state:
                found = visit(nxt)
                if found is not None:
                    return found
        state[node] = 2
        return None

    for name in rules:
        if name not in state:
            found = visit(name)
            if found is not None:
                return found
    return None

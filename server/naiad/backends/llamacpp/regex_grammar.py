"""A regular expression as a GBNF grammar, for vLLM's `structured_outputs` {"regex": ...}: the whole output matches it.

Python's own regex parser (`re._parser`) reads the pattern, so what it accepts and how it groups is Python's; the
tree is then written as GBNF. Classes are ASCII as in xgrammar and ECMAScript (`\\d` is [0-9], `\\w` [0-9A-Za-z_],
`\\s` the six ASCII spaces), so every output of the grammar matches the pattern under Python's `re.fullmatch` too.
`.` is any character but a newline. Lazy quantifiers match the same whole strings as greedy ones and are taken
as such; `^` at the start and `$` at the end are the whole-match anchors the output has anyway. Refused, naming
the construct: lookarounds, backreferences, conditionals, anchors and word boundaries inside the pattern, and
inline flags (`(?i)`), none of which a context-free grammar over characters can follow here.
"""

from __future__ import annotations

import re
import re._constants as c
import re._parser as sre

from ...errors import InvalidArgument

MAX_PATTERN = 4096  # characters: a regex is a request field, its grammar is built on the request's path
MAX_EXPANSION = 100_000  # grammar elements after llama.cpp spells out x{m,n} (nested counts multiply)
_EMPTY = '""'
_DIGIT = [(ord("0"), ord("9"))]
_WORD = [(ord("0"), ord("9")), (ord("A"), ord("Z")), (ord("_"), ord("_")), (ord("a"), ord("z"))]
_SPACE = [(ord(ch), ord(ch)) for ch in " \t\n\r\f\v"]
_CATEGORIES = {
    c.CATEGORY_DIGIT: (_DIGIT, False),
    c.CATEGORY_NOT_DIGIT: (_DIGIT, True),
    c.CATEGORY_WORD: (_WORD, False),
    c.CATEGORY_NOT_WORD: (_WORD, True),
    c.CATEGORY_SPACE: (_SPACE, False),
    c.CATEGORY_NOT_SPACE: (_SPACE, True),
}
_REFUSED = {
    c.ASSERT: "a lookahead or lookbehind",
    c.ASSERT_NOT: "a negative lookahead or lookbehind",
    c.GROUPREF: "a backreference",
    c.GROUPREF_EXISTS: "a conditional group",
}


def regex_grammar(pattern: object) -> str:
    """The GBNF grammar whose strings are the whole matches of `pattern`; InvalidArgument for a pattern that is
    not a regular expression or uses what a grammar cannot follow."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidArgument("structured_outputs.regex must be a non-empty string")
    if len(pattern) > MAX_PATTERN:
        raise InvalidArgument(f"structured_outputs.regex is longer than {MAX_PATTERN} characters")
    try:
        tree = sre.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise InvalidArgument(f"structured_outputs.regex is not a valid regular expression: {exc}") from None
    if tree.state.flags & ~(re.UNICODE | re.ASCII):
        raise InvalidArgument("structured_outputs.regex: inline flags such as (?i) are not supported")
    items = list(tree)
    if items and items[0][0] is c.AT and items[0][1] in (c.AT_BEGINNING, c.AT_BEGINNING_STRING):
        items = items[1:]
    if items and items[-1][0] is c.AT and items[-1][1] in (c.AT_END, c.AT_END_STRING):
        items = items[:-1]
    try:
        body, size = _sequence(items)
    except RecursionError:
        raise InvalidArgument("structured_outputs.regex nests too deeply") from None
    if size > MAX_EXPANSION:
        raise InvalidArgument(
            f"structured_outputs.regex repeats too much: its grammar would hold about {size:,} elements once "
            f"its counted repetitions are spelled out (at most {MAX_EXPANSION:,})"
        )
    return f"root ::= {body}\n"


def _sequence(items) -> tuple[str, int]:
    """GBNF for a sequence of parsed items, and its size once llama.cpp spells out counted repetitions."""
    parts: list[tuple[str, int]] = []
    run: list[int] = []  # consecutive literal characters: one GBNF string
    for op, av in [*items, (None, None)]:
        if op is c.LITERAL:
            run.append(av)
            continue
        if run:
            parts.append(('"' + "".join(_char(ch, in_class=False) for ch in run) + '"', len(run)))
            run = []
        if op is not None:
            parts.append(_item(op, av))
    text = " ".join(t for t, _ in parts if t)
    return (text or _EMPTY), sum(n for _, n in parts) or 1


def _group(items) -> tuple[str, int]:
    text, size = _sequence(list(items))
    return f"({text})", size


def _item(op, av) -> tuple[str, int]:
    if op is c.LITERAL:
        return f'"{_char(av, in_class=False)}"', 1
    if op is c.NOT_LITERAL:
        return _class([(av, av)], negate=True), 1
    if op is c.ANY:
        return _class([(10, 10)], negate=True), 1
    if op is c.IN:
        return _in(av), 1
    if op is c.BRANCH:
        alternatives = [_sequence(list(alt)) for alt in av[1]]
        return "(" + " | ".join(t for t, _ in alternatives) + ")", sum(n for _, n in alternatives)
    if op is c.SUBPATTERN:
        _index, add_flags, del_flags, sub = av
        if add_flags or del_flags:
            raise InvalidArgument("structured_outputs.regex: inline flags such as (?i:...) are not supported")
        return _group(sub)
    if op is c.ATOMIC_GROUP:
        return _group(av)
    if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
        low, high, sub = av
        inner, size = _group(sub)
        if high is c.MAXREPEAT:
            text = f"{inner}*" if low == 0 else f"{inner}+" if low == 1 else f"{inner}{{{low},}}"
            return text, size * max(low + 1, 1)
        if (low, high) == (0, 1):
            return f"{inner}?", size
        return (f"{inner}{{{low}}}" if low == high else f"{inner}{{{low},{high}}}"), size * max(high, 1)
    if op is c.CATEGORY:
        ranges, negate = _CATEGORIES[av]
        return _class(ranges, negate), 1
    if op is c.AT:
        raise InvalidArgument(
            "structured_outputs.regex: anchors and word boundaries are supported only as ^ at the start and $ at "
            "the end"
        )
    what = _REFUSED.get(op, str(op).lower())
    raise InvalidArgument(f"structured_outputs.regex: {what} cannot be followed by a grammar")


def _in(items) -> str:
    negate = False
    ranges: list[tuple[int, int]] = []
    for op, av in items:
        if op is c.NEGATE:
            negate = True
        elif op is c.LITERAL:
            ranges.append((av, av))
        elif op is c.RANGE:
            ranges.append(av)
        elif op is c.CATEGORY:
            cat, cat_negated = _CATEGORIES[av]
            if cat_negated:
                raise InvalidArgument(
                    "structured_outputs.regex: a negated class (\\D, \\W, \\S) inside [...] is not supported"
                )
            ranges.extend(cat)
        else:
            raise InvalidArgument(
                f"structured_outputs.regex: {str(op).lower()} inside [...] is not supported"
            )
    return _class(ranges, negate)


def _class(ranges: list[tuple[int, int]], negate: bool) -> str:
    body = "".join(
        _char(lo, in_class=True) if lo == hi else f"{_char(lo, in_class=True)}-{_char(hi, in_class=True)}"
        for lo, hi in ranges
    )
    return f"[{'^' if negate else ''}{body}]"


def _char(code: int, in_class: bool) -> str:
    """One character as llama.cpp's grammar parser reads it in a literal or a class: its escapes are \\\\, \\", \\[,
    \\] and \\x/\\u/\\U; a class's - and ^ are written as hex so they are never a range or a negation."""
    if code < 0x20 or code == 0x7F or (in_class and chr(code) in "-^"):
        return f"\\x{code:02X}"
    if code > 0xFFFF:
        return f"\\U{code:08X}"
    ch = chr(code)
    return "\\" + ch if ch in ('\\"[]' if in_class else '\\"') else ch

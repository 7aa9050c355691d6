"""The server's rooms in order: each import must run down the declared order (issue 61).

A room is a top-level module or package of `naiad`, and, inside a package that declares an order of its own (ROOMS
below), one of that package's subpackages. Rooms are listed top to bottom in levels; a level's rooms are siblings.
A module may import from its own room and from rooms of lower levels; an import that runs up the order, or sideways
between two sibling rooms, is a finding. Every import statement is read statically, at any depth (as
tools/import_cycles.py reads them). Prints each finding and exits 1 if there is any; an import listed in
KNOWN_UPWARD is tolerated and printed as debt to be removed (and an entry that no longer matches an import is a
finding, so that the list only shrinks). `tests/test_imports.py` and `make lint` run it over server/.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_cycles import import_sites, modules

# Top to bottom. "*": every room of the package that no level names.
ROOMS: dict[str, list[tuple[str, ...]]] = {
    "naiad": [
        ("cli",),  # the command line
        ("app", "analyze"),  # what it runs: the server's process, the load analyzer
        ("engine",),  # frontend worker processes and the engine process they call
        (
            "endpoints",
        ),  # the HTTP, gRPC and OpenAI endpoints, set up once: by app (one process) and each worker
        ("serve_flags",),  # `naiad serve`'s command line, read alike by the engine process and its workers
        ("frontends",),  # the protocols
        ("server",),  # Server: the serving API in one process
        ("serving",),  # the serving API the frontends call (Protocols): Server and the engine's EngineClient
        ("repository",),
        ("model", "orchestration", "warmup"),
        ("scheduling",),
        ("backends",),
        ("llm", "shared_memory", "cache", "trace", "host_pinning"),
        ("device_tensors", "memory", "custom_metrics", "otel", "logsettings", "config", "version_string"),
        (
            "cuda_runtime",
            "tensors",
            "inference",
            "gpu",
            "stats",
            "metrics",
            "classification",
            "storage",
            "flags",
            "stop_signals",
            "cpus",
            "python_isolation",
        ),
        ("errors",),
    ],
    "naiad.frontends": [  # no module of its own: packages only
        (
            "openai",
        ),  # the OpenAI API and the LLM APIs' app: it mounts Anthropic's Messages routes beside its own
        ("anthropic",),  # Anthropic's Messages API
        ("llm",),  # what the LLM APIs share: the request, chat templates, the generation service, shaping
        (
            "http",
            "grpc",
        ),  # the protocols: neither imports the other (the LLM rooms use http's body, site, SSE)
        ("triton",),  # Triton's extensions both protocols share (request parameters, shared memory)
        ("transport",),  # socket and connection plumbing
    ],
    "naiad.frontends.grpc": [
        ("*",),  # the gRPC frontend, its service, codec, messages and calls
        ("h2",),  # the HTTP/2 server under them: imports only itself and transport
    ],
}

# Imports that run up the order today, each to be removed (and then removed from here): none now. Repository and
# ModelOrchestrator also hold each other, but at run time only (orchestration imports nothing of repository).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def room(scope: str, module: str) -> str | None:
    """The room of `scope` that `module` is in, "*" for one no level names (None: `module` is the scope's package
    itself, or outside it)."""
    if not module.startswith(scope + "."):
        return None
    name = module[len(scope) + 1 :].split(".")[0]
    if all(name not in rooms for rooms in ROOMS[scope]) and any("*" in rooms for rooms in ROOMS[scope]):
        return "*"
    return name


def level(scope: str, name: str) -> int | None:
    """The level of room `name` in `scope`'s order, counted from the top (None: not declared)."""
    for i, rooms in enumerate(ROOMS[scope]):
        if name in rooms:
            return i
    return None


def check(root: Path) -> tuple[list[str], list[str]]:
    """(findings, tolerated upward imports) of the tree under `root`."""
    findings: list[str] = []
    known: list[str] = []
    seen_known: set[tuple[str, str]] = set()
    names = set(modules(root))
    for scope, levels in ROOMS.items():
        if scope not in names:
            continue
        rooms = {room(scope, m) for m in names} - {None}
        declared = {r for rs in levels for r in rs}
        for r in sorted(rooms):
            if level(scope, r) is None:
                findings.append(
                    f"{scope}.{r} is not in the declared order of {scope} (tools/import_rooms.py)"
                )
        for r in sorted(declared - rooms - {"*"}):
            findings.append(f"{scope}.{r} is in the declared order of {scope} but not in the tree")
    for importer, imported, path, line in sorted(set(import_sites(root))):
        scope = "naiad"
        while scope in ROOMS:
            a, b = room(scope, importer), room(scope, imported)
            if a is None or b is None:
                break
            if a == b:
                scope = f"{scope}.{a}"
                continue
            la, lb = level(scope, a), level(scope, b)
            if la is None or lb is None or la < lb:
                break
            where = f"{path}:{line}: {importer} -> {imported}"
            way = "sideways" if la == lb else "up"
            if (importer, imported) in KNOWN_UPWARD:
                seen_known.add((importer, imported))
                known.append(f"{where} (runs {way}, {a} -> {b} in {scope}; known, to be removed)")
            else:
                findings.append(f"{where} runs {way} the declared order ({a} -> {b} in {scope})")
            break
    if "naiad" in names:
        for importer, imported in sorted(KNOWN_UPWARD - seen_known):
            findings.append(
                f"KNOWN_UPWARD lists {importer} -> {imported}, which is no longer imported: remove it"
            )
    return findings, known


def main() -> int:
    bad = False
    for root in sys.argv[1:] or ["server"]:
        findings, known = check(Path(root))
        for line in known:
            print(f"known upward import in {root}/, to be removed: {line}")
        for line in findings:
            print(f"import order in {root}/: {line}")
            bad = True
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

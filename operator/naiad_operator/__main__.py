"""`naiad-operator` / `python -m naiad_operator`: run the kopf operator with Naiad's handlers."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

import kopf


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="naiad-operator",
        description="Reconcile naiad.dev InferenceServers and InferenceModels into serving pods.",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        dest="namespaces",
        action="append",
        default=[],
        help="watch this namespace (repeatable; globs like 'team-*' allowed)",
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)"
    )
    parser.add_argument(
        "--liveness",
        default=os.environ.get("NAIAD_LIVENESS", "http://0.0.0.0:8080/healthz"),
        help="URL the liveness endpoint listens on ('' to disable)",
    )
    parser.add_argument("--log-format", choices=["plain", "full", "json"], default="full")
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    verbosity.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    namespaces = list(args.namespaces)
    if not namespaces and os.environ.get("NAIAD_WATCH_NAMESPACES"):
        namespaces = [n.strip() for n in os.environ["NAIAD_WATCH_NAMESPACES"].split(",") if n.strip()]
    kopf.configure(verbose=args.verbose, quiet=args.quiet, log_format=kopf.LogFormat[args.log_format.upper()])
    # Importing registers the handlers with kopf's default registry.
    importlib.import_module("naiad_operator.handlers")
    kopf.run(
        # One replica with a Recreate strategy: no peering objects, no leader election needed.
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`naiad-operator` / `python -m naiad_operator`: run the kopf operator with Naiad's handlers."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from collections.abc import Sequence

import kopf

from . import timeline
from .config import service_account_namespace


def _own_namespace() -> str:
    return service_account_namespace() or "default"


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
    parser.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("NAIAD_LEADER_ELECT", "false").lower() in ("1", "true", "yes"),
        help="run as one of several replicas: reconcile only while holding the Lease (default: off, or "
        "$NAIAD_LEADER_ELECT)",
    )
    parser.add_argument(
        "--leader-elect-namespace",
        default=os.environ.get("NAIAD_LEADER_ELECT_NAMESPACE") or _own_namespace(),
        help="namespace of the Lease (default: $NAIAD_LEADER_ELECT_NAMESPACE, else the pod's own namespace)",
    )
    parser.add_argument(
        "--leader-elect-lease",
        default=os.environ.get("NAIAD_LEADER_ELECT_LEASE", "naiad-operator"),
        help="name of the Lease (default: naiad-operator)",
    )
    parser.add_argument(
        "--leader-elect-timing",
        default=os.environ.get("NAIAD_LEADER_ELECT_TIMING", ""),
        help="lease duration, renew deadline and retry period in seconds, e.g. '10,7,2' (the default)",
    )
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
    timeline.enable_from_env()
    # Importing registers the handlers with kopf's default registry.
    importlib.import_module("naiad_operator.handlers")
    if args.leader_elect:
        from .elected import run_elected, timing_from

        return asyncio.run(
            run_elected(
                namespace=args.leader_elect_namespace,
                lease=args.leader_elect_lease,
                timing=timing_from(args.leader_elect_timing),
                liveness=args.liveness,
                clusterwide=not namespaces,
                namespaces=namespaces,
            )
        )
    kopf.run(
        # A single replica: kopf's own peering is off (leader election, above, is how replicas share the work).
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A Ray cluster over the pods of one LeaderWorkerSet group, for a vLLM engine larger than a node.

`python -m naiad.llm.ray_group leader --size N [ray start options] -- naiad serve ...` starts Ray's head in the
leader's pod, waits until the group's N nodes (the head and N-1 workers) are alive in it, then becomes the given
command (the server, whose vLLM engine places its tensor- and pipeline-parallel workers on the group's GPUs through
Ray). `python -m naiad.llm.ray_group worker --leader ADDRESS [ray start options]` joins the leader's cluster and
stays in the foreground while it lives (retrying while the head is not up yet), so a worker whose Ray node stops
exits and the LeaderWorkerSet recreates the group. The same steps as the LWS project's vLLM example
(`ray_init.sh`), without a shell in between and with errors that say what was waited for.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

RAY_PORT = 6379
TIMEOUT_S = 600.0  # a node's image pull and Ray's start-up on a busy cluster; the group restarts past this
POLL_S = 2.0
# ray's own `start` options: no usage reporting from any node, no dashboard on the head (nothing here serves it)
COMMON = ["--disable-usage-stats"]
HEAD = [*COMMON, "--include-dashboard=false"]
# prints the number of alive nodes of the cluster at the address given as argv[1] (a fresh process each time:
# a driver connected to the cluster in this process would stay connected in the server it becomes)
_COUNT = (
    "import json, sys, ray\n"
    "ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
    "print(json.dumps(sum(1 for n in ray.nodes() if n['Alive'])))\n"
)


def _ray() -> str:
    """The `ray` command next to this interpreter (the image's environment), else on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "ray")
    found = local if os.access(local, os.X_OK) else shutil.which("ray")
    if found is None:
        raise SystemExit("ray_group: the `ray` command is not installed (pip install 'ray>=2.40')")
    return found


def alive_nodes(address: str, timeout: float = 60.0) -> int:
    """Alive nodes in the Ray cluster at `address` (0 when it cannot be asked)."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _COUNT, address],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        ).stdout
        return int(json.loads(out.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return 0


def leader(size: int, port: int, timeout: float, ray_options: list[str], command: list[str]) -> int:
    address = f"127.0.0.1:{port}"
    started = subprocess.run([_ray(), "start", "--head", f"--port={port}", *HEAD, *ray_options])
    if started.returncode != 0:
        print(f"ray_group: `ray start --head` failed with status {started.returncode}", file=sys.stderr)
        return started.returncode or 1
    deadline = time.monotonic() + timeout
    alive = 0
    while True:
        alive = alive_nodes(address)
        if alive >= size:
            break
        if time.monotonic() >= deadline:
            print(
                f"ray_group: {alive} of the group's {size} Ray nodes joined within {timeout:.0f} s; giving up "
                "(the LeaderWorkerSet recreates the group)",
                file=sys.stderr,
            )
            subprocess.run([_ray(), "stop", "--force"], capture_output=True)
            return 1
        time.sleep(POLL_S)
    print(
        f"ray_group: the group's {size} Ray nodes are alive; starting {command[0]}",
        file=sys.stderr,
        flush=True,
    )
    env = dict(os.environ, RAY_ADDRESS=address)  # vLLM's ray.init() joins this cluster
    os.execvpe(command[0], command, env)
    return 1  # (not reached)


def worker(address: str, port: int, timeout: float, ray_options: list[str]) -> int:
    target = address if ":" in address else f"{address}:{port}"
    deadline = time.monotonic() + timeout
    while True:
        # --block: ray start stays in the foreground while this node runs, and fails at once when the head
        # cannot be reached (not up yet, or gone)
        code = subprocess.run(
            [_ray(), "start", f"--address={target}", "--block", *COMMON, *ray_options]
        ).returncode
        if code == 0 or time.monotonic() >= deadline:
            if code:
                print(
                    f"ray_group: could not join the Ray head at {target} within {timeout:.0f} s",
                    file=sys.stderr,
                )
            return code
        time.sleep(POLL_S * 2)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(prog="python -m naiad.llm.ray_group", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role", required=True)
    lead = sub.add_parser(
        "leader", help="start Ray's head, wait for the group, then run the command after --"
    )
    lead.add_argument("--size", type=int, required=True, help="the group's pods ($(LWS_GROUP_SIZE))")
    work = sub.add_parser("worker", help="join the leader's Ray cluster and stay in the foreground")
    work.add_argument("--leader", required=True, help="the leader's address ($(LWS_LEADER_ADDRESS))")
    for parser in (lead, work):
        parser.add_argument("--port", type=int, default=RAY_PORT, help="the head's GCS port")
        parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds to wait for the group")
    args, ray_options = p.parse_known_args(argv)
    if args.role == "leader":
        if args.size < 1:
            p.error("--size must be at least 1")
        if not command:
            p.error("leader: the command to run once the group is up goes after --")
        return leader(args.size, args.port, args.timeout, ray_options, command)
    if command:
        p.error("worker: takes no command")
    return worker(args.leader, args.port, args.timeout, ray_options)


if __name__ == "__main__":
    sys.exit(main())

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
import hashlib
import json
import os
import shutil
import signal
import socket
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


def use_token(variable: str) -> None:
    """Ray's token authentication for this process and what it starts (`ray start`, the server's vLLM engine):
    the token is derived from the secret in `variable` (the operator passes the pool's control credential), so the
    group's nodes share it and nothing without it can join the cluster or run code on it."""
    secret = os.environ.get(variable, "")
    if not secret:
        raise SystemExit(
            f"ray_group: --token-from-env {variable}: the variable is not set; refusing an open cluster"
        )
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = hashlib.sha256(b"naiad-ray-group\0" + secret.encode()).hexdigest()


def _command(name: str) -> str | None:
    """The command `name` of the environment Naiad runs in (next to this interpreter: its `ray`, its `naiad`),
    else on PATH; None when neither has it."""
    local = os.path.join(os.path.dirname(sys.executable), name)
    return local if os.access(local, os.X_OK) else shutil.which(name)


def _ray() -> str:
    found = _command("ray")
    if found is None:
        raise SystemExit("ray_group: the `ray` command is not installed (pip install 'naiad[vllm]')")
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


def _node_ip(ray_options: list[str]) -> str | None:
    """The --node-ip-address among `ray start`'s options (the pod's IP, as the operator passes it)."""
    for i, option in enumerate(ray_options):
        if option.startswith("--node-ip-address="):
            return option.partition("=")[2]
        if option == "--node-ip-address" and i + 1 < len(ray_options):
            return ray_options[i + 1]
    return None


def leader(size: int, port: int, timeout: float, ray_options: list[str], command: list[str]) -> int:
    address = f"{_node_ip(ray_options) or '127.0.0.1'}:{port}"
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
    try:
        os.execve(_command(command[0]) or command[0], command, env)
    except OSError as exc:
        print(f"ray_group: cannot run {command[0]}: {exc}", file=sys.stderr)
    return 127


_stopping = False  # the pod is stopping (SIGTERM): the Ray node drains and exits, nothing is retried


def _foreground(argv: list[str]) -> int:
    """Run `argv`, passing SIGTERM and SIGINT on to it (the pod's stop reaches the Ray node, which drains and
    exits), and return its status."""
    child = subprocess.Popen(argv)

    def forward(signum: int, _frame) -> None:
        global _stopping
        _stopping = True
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def worker(address: str, port: int, timeout: float, ray_options: list[str]) -> int:
    host, sep, given = address.rpartition(":")
    if not sep:
        host, given = address, ""
    target = f"{host}:{given or port}"
    deadline = time.monotonic() + timeout
    code = 1
    while time.monotonic() < deadline and not _stopping:
        # the leader's name resolves once its pod is in the group's headless Service; Ray gets its address
        try:
            ip = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
        except OSError:
            time.sleep(POLL_S)
            continue
        target = f"{ip}:{given or port}"
        # --block: ray start stays in the foreground while this node runs, and fails when the head cannot be
        # reached (not up yet, or gone)
        code = _foreground([_ray(), "start", f"--address={target}", "--block", *COMMON, *ray_options])
        if code == 0 or _stopping:
            return code
        time.sleep(POLL_S * 2)
    print(
        f"ray_group: could not join the Ray head at {address} ({target}) within {timeout:.0f} s",
        file=sys.stderr,
    )
    return code


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
        parser.add_argument(
            "--token-from-env",
            metavar="VARIABLE",
            help="Ray's token authentication, the token derived from this variable's secret (same on every pod)",
        )
    args, ray_options = p.parse_known_args(argv)
    if args.token_from_env:
        use_token(args.token_from_env)
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

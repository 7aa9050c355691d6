"""Make simulated pod IPs locally bindable (no CNI, no containers).

Why not 127.0.1.0/24: kwok would happily hand out loopback pod IPs, but the
real kube-apiserver refuses loopback (and link-local) addresses in
EndpointSlices (``ValidateEndpointIP``: "may not be in the loopback range"), so
Services would never get endpoints.  The pod CIDR is therefore a normal,
non-routed test range (198.18.0.0/15, RFC 2544 benchmarking) and this module
makes it local with an "AnyIP" route, ``local 198.18.0.0/24 dev lo`` in the
``local`` routing table: every address of the range can then be bound and
connected to on this host, exactly like 127.0.0.0/8.

Modes (``$NAIAD_E2E_POD_NETWORK`` or the ``mode`` argument):

``auto`` (default)
    nothing if the CIDR is already bindable; otherwise ``netns``.
``netns``
    move *this process* (it must still be single-threaded) into a new network
    namespace - and a new user namespace unless it is root - bring ``lo`` up
    and add the local route there.  Nothing on the host changes, no
    privileges are needed where unprivileged user namespaces are allowed, and
    everything started afterwards (control plane, kwok, pod processes, the
    operator under test) shares that namespace.  The process loses access to
    the outside network, so build binaries / download things first.
``host-route``
    add the route in the current namespace (needs CAP_NET_ADMIN, changes the
    host until ``remove_routes``/process exit cleanup).
``none``
    do nothing (the caller has arranged it, e.g. ``unshare -rn`` + ``ip route``).

Implemented with rtnetlink/ioctl from the standard library (no iproute2 needed).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Iterable

DEFAULT_MODE = "auto"

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000

_state = {"netns": False, "routes": []}  # routes added by host-route mode
_lock = threading.Lock()


class PodNetworkError(RuntimeError):
    pass


# ------------------------------------------------------------------ checks
def bindable(ip: str) -> bool:
    s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((ip, 0))
        return True
    except OSError:
        return False
    finally:
        s.close()


def cidr_bindable(cidr: str) -> bool:
    net = ipaddress.ip_network(cidr, strict=False)
    hosts = (
        [net.network_address + 1, net.broadcast_address - 1]
        if net.num_addresses > 2
        else [net.network_address]
    )
    return all(bindable(str(h)) for h in hosts)


def in_private_netns() -> bool:
    """True once this process has moved itself into its own network namespace."""
    return _state["netns"]


# ------------------------------------------------------------------ netlink / ioctl
def _lo_up() -> None:
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH14s", b"lo", 0, b"\0" * 14)
        flags = struct.unpack("16sH14s", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, ifr))[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b"\0" * 14))


def _route(cidr: str, add: bool) -> None:
    """rtnetlink: (add|del) ``local <cidr> dev lo table local``."""
    net = ipaddress.ip_network(cidr, strict=False)
    if net.version != 4:
        raise PodNetworkError(f"only IPv4 pod CIDRs are supported, got {cidr}")
    RTM_NEWROUTE, RTM_DELROUTE, NLMSG_ERROR = 24, 25, 2
    NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 1, 4, 0x200, 0x400
    RT_TABLE_LOCAL, RTPROT_STATIC, RT_SCOPE_HOST, RTN_LOCAL = 255, 4, 254, 2
    RTA_DST, RTA_OIF = 1, 4
    lo = socket.if_nametoindex("lo")

    def rta(kind: int, payload: bytes) -> bytes:
        ln = 4 + len(payload)
        return struct.pack("HH", ln, kind) + payload + b"\0" * ((4 - ln % 4) % 4)

    body = struct.pack(
        "BBBBBBBBI",
        socket.AF_INET,
        net.prefixlen,
        0,
        0,
        RT_TABLE_LOCAL,
        RTPROT_STATIC,
        RT_SCOPE_HOST,
        RTN_LOCAL,
        0,
    )
    body += rta(RTA_DST, net.network_address.packed) + rta(RTA_OIF, struct.pack("I", lo))
    flags = NLM_F_REQUEST | NLM_F_ACK | ((NLM_F_CREATE | NLM_F_EXCL) if add else 0)
    msg = struct.pack("IHHII", 16 + len(body), RTM_NEWROUTE if add else RTM_DELROUTE, flags, 1, 0) + body
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
        s.bind((0, 0))
        s.send(msg)
        data = s.recv(65536)
    _ln, typ = struct.unpack_from("IH", data, 0)
    if typ == NLMSG_ERROR:
        err = -struct.unpack_from("i", data, 16)[0]
        if err == 0 or (add and err == errno.EEXIST):
            return
        raise PodNetworkError(
            f"{'adding' if add else 'deleting'} route local {cidr} dev lo: {os.strerror(err)}"
        )


def _unshare_netns() -> None:
    if len(os.listdir("/proc/self/task")) != 1:
        raise PodNetworkError(
            "cannot move into a private network namespace: the process already has threads "
            f"({threading.active_count()} Python threads). Create the cluster before starting threads, "
            "or run the tests under `unshare -rn` / set NAIAD_E2E_POD_NETWORK=host-route (see e2e/README.md)"
        )
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    # root: a network namespace alone; otherwise (or if that is refused, e.g.
    # root without CAP_SYS_ADMIN in a container) user + network namespaces
    attempts = ([_CLONE_NEWNET] if uid == 0 else []) + [_CLONE_NEWUSER | _CLONE_NEWNET]
    used, err = None, 0
    for fl in attempts:
        if libc.unshare(fl) == 0:
            used = fl
            break
        err = ctypes.get_errno()
    if used is None:
        raise PodNetworkError(
            f"unshare() of a network namespace failed: {os.strerror(err)}. Unprivileged user namespaces may be "
            "disabled; run as root, under `unshare -rn`, or with NAIAD_E2E_POD_NETWORK=host-route "
            "(see e2e/README.md)"
        )
    if used & _CLONE_NEWUSER:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1\n")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1\n")
    _lo_up()
    _state["netns"] = True


# ------------------------------------------------------------------ entry points
def ensure_pod_network(cidrs: Iterable[str], mode: str | None = None) -> str:
    """Make every address of ``cidrs`` bindable; returns the mode actually used
    ("bindable", "netns", "host-route" or "none")."""
    cidrs = list(cidrs)
    mode = (mode or os.environ.get("NAIAD_E2E_POD_NETWORK") or DEFAULT_MODE).lower()
    if mode not in ("auto", "netns", "host-route", "none"):
        raise PodNetworkError(f"unknown pod network mode {mode!r}")
    with _lock:
        if mode == "none":
            return "none"
        if mode == "auto" and all(cidr_bindable(c) for c in cidrs):
            return "bindable"
        if mode in ("auto", "netns"):
            if not _state["netns"]:
                _unshare_netns()
            for c in cidrs:
                _route(c, add=True)
            if not all(cidr_bindable(c) for c in cidrs):
                raise PodNetworkError(
                    f"pod CIDRs {cidrs} still not bindable in the private network namespace"
                )
            return "netns"
        # host-route
        for c in cidrs:
            if cidr_bindable(c):
                continue
            _route(c, add=True)
            _state["routes"].append(c)
        if len(_state["routes"]) and not getattr(ensure_pod_network, "_atexit", False):
            atexit.register(remove_routes)
            ensure_pod_network._atexit = True  # type: ignore[attr-defined]
        return "host-route"


def remove_routes(cidrs: Iterable[str] | None = None) -> None:
    """Remove routes this module added in host-route mode (no-op otherwise)."""
    with _lock:
        todo = list(_state["routes"]) if cidrs is None else [c for c in cidrs if c in _state["routes"]]
        for c in todo:
            try:
                _route(c, add=False)
            except PodNetworkError:
                pass
            _state["routes"].remove(c)

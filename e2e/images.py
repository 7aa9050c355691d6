"""Run processes from the built images (`make images`) as a container runtime would, with bubblewrap.

``ImageStore`` maps an image name (``ghcr.io/naiad-dev/naiad-server:0.1.0``, as pod specs name it) to its
docker-archive (``build/images/*.digest`` list them) and unpacks each archive once (skopeo -> OCI layout ->
umoci runtime bundle), cached by image ID.  ``ContainerSpec.argv()`` turns an unpacked image plus Kubernetes
container fields into a ``bwrap`` command line:

* the image's root file system read-only at ``/`` (every container shares the cached unpacked copy and cannot
  write into it); ``/tmp`` and ``/dev/shm`` fresh tmpfs (1777), ``/proc`` and ``/dev`` fresh, ``readOnlyRootFilesystem`` is
  therefore always in effect outside volumes and /tmp;
* ``command`` replaces ENTRYPOINT and drops CMD, ``args`` replace CMD (Kubernetes' rules);
* the image's ``Env`` under the container's env, passed as bwrap's own environment (``full_env()``; nothing of
  the host's leaks in, and Secret values stay off command lines);
* volumes bound at their mount paths (read-only where the mount says so); the mount point directories are
  created, empty, in the cached root file system (as runc creates them in a container's root);
* the image's user, or ``securityContext.runAsUser/runAsGroup``, set with ``setpriv`` (supplementary groups:
  fsGroup and supplementalGroups only) after the namespace setup, the working directory from ``workingDir`` or the image's ``WorkingDir``.

The network namespace is the caller's: bwrap is not asked for a new one, so a container started from a process
inside e2e/podnet.py's private namespace shares it (its pod IP is bindable there), as host processes do.

Every container gets a PID namespace of its own (``--unshare-pid``): bwrap's reaper is its PID 1 and the container's
command PID 2.  That is what ties the container's processes to it.  ``--die-with-parent`` alone did not: it is a
parent-death signal (PR_SET_PDEATHSIG), which the kernel clears when a process changes its user IDs, and setpriv does
exactly that, so a SIGKILLed bwrap (a test killing "the container", a runner killed mid-run) left the server running
as uid 10001 with its pod IP's ports bound.  Now bwrap's PID 1 keeps the signal (it runs as root and never changes
credentials); when it dies the kernel kills every process in the namespace, and it is reaped (bwrap, and so the
``Popen``, exits) only after all of them have exited.  ``stop_container()`` is the runtime's stop: SIGTERM to the
command, SIGKILL to the namespace after the grace period, and a wait until no process of the namespace is left.
Needs root (CI and the dev machines are), skopeo, umoci, bwrap and setpriv inside the image (util-linux).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARCHIVES = Path(os.environ.get("NAIAD_IMAGES_OUT", ROOT / "build" / "images"))
DEFAULT_CACHE = Path(os.environ.get("NAIAD_E2E_IMAGES_CACHE", Path.home() / ".cache" / "naiad-e2e-images"))
TOOLS = ("skopeo", "umoci", "bwrap")


class ImageError(RuntimeError):
    """An image that cannot be found, unpacked or run (the pod gets ErrImagePull / CreateContainerError)."""


def missing_tools() -> str | None:
    """Why images cannot be run here, or None."""
    if os.geteuid() != 0:
        return (
            "unpacking and running an image's root file system needs root (CI and the dev machines are root)"
        )
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} missing: `make images` installs them"
    return None


@dataclass
class Image:
    """One unpacked image: its root file system and the parts of its config a runtime uses."""

    name: str
    image_id: str
    rootfs: Path
    entrypoint: list[str]
    cmd: list[str]
    env: list[str]
    cwd: str
    uid: int
    gid: int

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(item.partition("=")[::2] for item in self.env)


def unpack_archive(archive: Path, dest: Path, name: str = "") -> Image:
    """docker-archive -> OCI layout -> runtime bundle under ``dest`` (which must not exist yet)."""
    archive = Path(archive)
    if not archive.exists():
        raise ImageError(f"{archive} missing: `make images` builds it")
    dest.mkdir(parents=True)
    try:
        subprocess.run(
            ["skopeo", "copy", "--quiet", f"docker-archive:{archive}", f"oci:{dest}/oci:img"],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            ["umoci", "unpack", "--image", f"{dest}/oci:img", str(dest / "bundle")],
            check=True,
            capture_output=True,
        )
        inspect = ["skopeo", "inspect", "--config", f"docker-archive:{archive}"]
        config = json.loads(subprocess.run(inspect, check=True, capture_output=True).stdout)
    except subprocess.CalledProcessError as e:
        shutil.rmtree(dest, ignore_errors=True)
        raise ImageError(f"unpacking {archive}: {e.stderr.decode(errors='replace')[-2000:]}") from e
    process = json.loads((dest / "bundle" / "config.json").read_text())["process"]
    image = config.get("config") or {}
    shutil.rmtree(dest / "oci", ignore_errors=True)  # the bundle is all a run needs
    meta = {
        "name": name,
        "entrypoint": image.get("Entrypoint") or [],
        "cmd": image.get("Cmd") or [],
        "env": process.get("env") or image.get("Env") or [],
        "cwd": process.get("cwd") or image.get("WorkingDir") or "/",
        "uid": int(process["user"]["uid"]),
        "gid": int(process["user"]["gid"]),
    }
    (dest / "image.json").write_text(json.dumps(meta))
    return _load(dest, name, dest.name)


def _load(dest: Path, name: str, image_id: str) -> Image:
    meta = json.loads((dest / "image.json").read_text())
    return Image(
        name=name or meta["name"],
        image_id=image_id,
        rootfs=dest / "bundle" / "rootfs",
        entrypoint=meta["entrypoint"],
        cmd=meta["cmd"],
        env=meta["env"],
        cwd=meta["cwd"],
        uid=meta["uid"],
        gid=meta["gid"],
    )


def _archive_id(archive: Path) -> str:
    """The image ID (config digest) from the archive's manifest; a hash of size+mtime if unreadable."""
    try:
        out = subprocess.run(
            ["tar", "-xOf", str(archive), "manifest.json"], check=True, capture_output=True
        ).stdout
        config = json.loads(out)[0]["Config"]
        return Path(config).name.removesuffix(".json").removeprefix("sha256:")[:32]
    except (subprocess.CalledProcessError, ValueError, KeyError, IndexError):
        st = archive.stat()
        return hashlib.sha256(f"{archive}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:32]


class ImageStore:
    """Image name -> unpacked Image, unpacked on first use and cached (by image ID) across runs.  Every rebuilt
    image has a new ID (~400 MB unpacked each): after unpacking one, cached images that no run has used for
    ``keep_days`` are removed (a use touches its directory)."""

    keep_days = float(os.environ.get("NAIAD_E2E_IMAGES_KEEP_DAYS", "2"))

    def __init__(
        self,
        archives: Mapping[str, str | os.PathLike] | None = None,
        cache_dir: str | os.PathLike = DEFAULT_CACHE,
    ) -> None:
        self.archives = {k: Path(v) for k, v in (archives or {}).items()}
        self.cache_dir = Path(cache_dir)
        self._lock = threading.Lock()
        self._images: dict[str, Image] = {}

    @classmethod
    def from_build(cls, out: str | os.PathLike = DEFAULT_ARCHIVES, **kw) -> ImageStore:
        """The images `make images` built: every ``*.digest`` line is ``<archive> <name> <digest> <size>``."""
        archives: dict[str, Path] = {}
        for digest in sorted(Path(out).glob("*.digest")):
            for line in digest.read_text().splitlines():
                parts = line.split("\t") if "\t" in line else line.split()
                if len(parts) >= 2:
                    archive = Path(parts[0])
                    if not archive.exists():  # the digest files name the path they were built at
                        archive = Path(out) / archive.name
                    archives[parts[1]] = archive
        return cls(archives, **kw)

    def knows(self, name: str) -> bool:
        return name in self.archives

    def get(self, name: str) -> Image:
        with self._lock:
            if name in self._images:
                return self._images[name]
            archive = self.archives.get(name)
            if archive is None:
                raise ImageError(f"image {name!r} is not one of the built images {sorted(self.archives)}")
            if not archive.exists():
                raise ImageError(f"{archive} missing: `make images` builds it")
            image_id = _archive_id(archive)
            dest = self.cache_dir / image_id
            if (dest / "image.json").exists():
                image = _load(dest, name, image_id)
                os.utime(dest)
            else:
                shutil.rmtree(dest, ignore_errors=True)
                tmp = self.cache_dir / f".{image_id}.{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                unpack_archive(archive, tmp, name)
                tmp.rename(dest)
                image = _load(dest, name, image_id)
                self.prune()
            self._images[name] = image
            return image

    def prune(self, keep_days: float | None = None) -> list[Path]:
        """Remove the cached unpacked images (and leftovers of interrupted unpacks) unused for ``keep_days``."""
        cutoff = time.time() - 86400 * (self.keep_days if keep_days is None else keep_days)
        removed = []
        for entry in self.cache_dir.iterdir():
            try:
                if entry.is_dir() and entry.stat().st_mtime < cutoff:
                    shutil.rmtree(entry)
                    removed.append(entry)
            except OSError:
                pass
        return removed


def _mkdir_in_root(rootfs: Path, target: str) -> str:
    """``mkdir -p target`` inside ``rootfs``, following symlinks (``/var/run -> /run``) within it, never out;
    returns the resolved path inside the container (bwrap would resolve such links against the host)."""
    here = rootfs
    parts = [p for p in target.split("/") if p and p != "."]
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            here = here.parent if here != rootfs else rootfs
            continue
        nxt = here / part
        if nxt.is_symlink():
            hops += 1
            if hops > 40:
                raise ImageError(f"too many symlinks resolving {target} in {rootfs}")
            link = os.readlink(nxt)
            parts = [p for p in link.split("/") if p and p != "."] + parts
            here = rootfs if link.startswith("/") else here
            continue
        try:
            nxt.mkdir(mode=0o755)
        except FileExistsError:  # there already, or made this moment by a container of the same image
            pass
        if not nxt.is_dir():
            raise ImageError(f"mount point {target} is not a directory in {rootfs}")
        here = nxt
    return "/" + str(here.relative_to(rootfs)).lstrip(".")


def _file_in_root(rootfs: Path, target: str) -> str:
    """An empty file at ``target`` inside ``rootfs`` (its directory made as ``_mkdir_in_root`` makes it), the mount
    point of a file bound over it; returns the resolved path inside the container."""
    parent, _, name = target.rstrip("/").rpartition("/")
    directory = _mkdir_in_root(rootfs, parent or "/")
    point = rootfs / directory.lstrip("/") / name
    if point.is_symlink() or point.is_dir():
        raise ImageError(f"mount point {target} is not a regular file in {rootfs}")
    point.touch(exist_ok=True)
    return directory.rstrip("/") + "/" + name


@dataclass
class Mount:
    source: Path
    target: str
    read_only: bool = False


@dataclass
class ContainerSpec:
    """A container to start from an image: Kubernetes' fields, already resolved (env expanded, volumes local)."""

    image: Image
    command: Sequence[str] | None = None  # replaces ENTRYPOINT (and drops CMD)
    args: Sequence[str] | None = None  # replaces CMD
    env: Mapping[str, str] = field(default_factory=dict)  # over the image's Env
    mounts: Iterable[Mount] = ()
    working_dir: str | None = None
    run_as_user: int | None = None
    run_as_group: int | None = None
    supplemental_groups: Sequence[int] = ()  # fsGroup and supplementalGroups, as the kubelet adds them
    hostname: str | None = None

    def process_argv(self) -> list[str]:
        if self.command:
            return [*self.command, *(self.args or [])]
        return [*self.image.entrypoint, *(self.image.cmd if self.args is None else self.args)]

    def full_env(self) -> dict[str, str]:
        env = self.image.env_dict
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        if self.hostname:
            env["HOSTNAME"] = self.hostname
        env.update(self.env)
        return env

    def user(self) -> tuple[int, int]:
        uid = self.image.uid if self.run_as_user is None else int(self.run_as_user)
        gid = self.image.gid if self.run_as_group is None else int(self.run_as_group)
        return uid, gid

    def groups_args(self) -> list[str]:
        groups = sorted({int(g) for g in self.supplemental_groups})
        return ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]

    def argv(self, process: Sequence[str] | None = None, die_with_parent: bool = True) -> list[str]:
        """The bwrap command line that runs ``process`` (default: the container's own argv) in the container.

        Start it with ``env=self.full_env()`` (exactly the container's environment: nothing of the host's), so
        that env values (Secrets) never appear on a command line."""
        rootfs = self.image.rootfs
        # A PID namespace per container (see the module's docstring): bwrap's reaper is PID 1, the command PID 2.
        cmd = ["bwrap", "--unshare-pid", "--ro-bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev"]
        cmd += ["--perms", "1777", "--tmpfs", "/tmp", "--perms", "1777", "--tmpfs", "/dev/shm"]
        if die_with_parent:
            cmd.append("--die-with-parent")
        for m in sorted(self.mounts, key=lambda m: len(m.target.rstrip("/"))):
            target = "/" + m.target.strip("/")
            if target.startswith("/tmp/") or target.startswith("/dev/"):
                # inside a fresh tmpfs: bwrap would create the parents 0700 (unreadable for a non-root user)
                parts = target.split("/")[2:-1]
                for i in range(len(parts)):
                    cmd += ["--perms", "0755", "--dir", "/".join(target.split("/")[:2] + parts[: i + 1])]
            elif m.source.is_file():
                # a file (a pod's /etc/hosts, as the kubelet mounts one): an empty file as its mount point
                target = _file_in_root(rootfs, target)
            elif target != "/tmp":
                # mount points inside the read-only root: created (empty) in the cached unpacked copy
                target = _mkdir_in_root(rootfs, target)
            cmd += ["--ro-bind" if m.read_only else "--bind", str(m.source), target]
        cmd += ["--chdir", self.working_dir or self.image.cwd or "/"]
        uid, gid = self.user()
        cmd += ["--", "/usr/bin/setpriv", "--reuid", str(uid), "--regid", str(gid), *self.groups_args(), "--"]
        argv = list(self.process_argv() if process is None else process)
        if not argv:
            raise ImageError(f"{self.image.name}: no command, args, ENTRYPOINT or CMD to run")
        return cmd + argv


def exec_argv(spec: ContainerSpec, bwrap_pid: int, process: Sequence[str]) -> list[str]:
    """``kubectl exec`` / an exec probe: ``process`` inside the running container (its mount and PID namespaces,
    root and working directory, as its user), or in a fresh view of the image when the container has no process
    yet.  Inside the PID namespace the process dies with the container."""
    init = container_init(bwrap_pid)
    if init is None:
        return spec.argv(process)
    uid, gid = spec.user()
    cmd = [
        "nsenter",
        "-t",
        str(init.pid),
        "-m",
        "-p",
        "-r",
        "-w",
        "--",
        "/usr/bin/setpriv",
        "--reuid",
        str(uid),
    ]
    return cmd + ["--regid", str(gid), *spec.groups_args(), "--", *process]


def container_init(bwrap_pid: int):
    """The container's PID 1 (bwrap's reaper, bwrap's only child), or None before bwrap has created it."""
    import psutil

    try:
        children = psutil.Process(bwrap_pid).children()
    except psutil.Error:
        return None
    return children[0] if children else None


def main_process(bwrap_pid: int):
    """The container's command (PID 2 in its namespace, after setpriv exec'd it), or None."""
    import psutil

    init = container_init(bwrap_pid)
    if init is None:
        return None
    try:
        children = init.children()
    except psutil.Error:
        return None
    return children[0] if children else None


def container_processes(bwrap_pid: int) -> list:
    """The processes inside a container started with ``ContainerSpec.argv()`` (bwrap's descendants: its PID 1
    first, then the command and whatever it started)."""
    import psutil

    try:
        return psutil.Process(bwrap_pid).children(recursive=True)
    except psutil.Error:
        return []


def pid_namespace(bwrap_pid: int, timeout: float = 5.0) -> str | None:
    """The container's PID namespace (``pid:[inode]``), waiting up to ``timeout`` for bwrap to create it; None if
    bwrap exited first.  Record it right after the start: ``reap()`` uses it to find the container's processes
    even after bwrap itself is gone."""
    deadline = time.monotonic() + timeout
    while True:
        init = container_init(bwrap_pid)
        if init is not None:
            try:
                ns = os.readlink(f"/proc/{init.pid}/ns/pid")
                if ns != os.readlink(f"/proc/{bwrap_pid}/ns/pid"):  # not the instant before its unshare
                    return ns
            except OSError:
                pass
        try:
            os.kill(bwrap_pid, 0)
        except ProcessLookupError:
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


def processes_in(pidns: str) -> list[int]:
    """The host PIDs of every process in the PID namespace ``pidns`` (as ``pid_namespace()`` returned it)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.readlink(f"/proc/{entry.name}/ns/pid") == pidns:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def reap(pidns: str | None, timeout: float = 10.0) -> list[int]:
    """SIGKILL whatever is left in a container's PID namespace and wait until it is empty (its processes have
    exited, so their sockets are closed and their ports free).  Returns the PIDs that had to be killed."""
    if not pidns:
        return []
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        left = processes_in(pidns)
        if not left:
            return killed
        for pid in left:
            # through a pidfd, checking the namespace again (a PID that exited since the scan may be reused); PID 1
            # or not, the kernel empties the namespace once its PID 1 is gone
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") == pidns:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    if pid not in killed:
                        killed.append(pid)
            except OSError:
                pass
            finally:
                os.close(fd)
        if time.monotonic() >= deadline:
            raise ImageError(f"processes {left} of container {pidns} did not exit after SIGKILL")
        time.sleep(0.02)


def signal_container(bwrap_pid: int, sig: int) -> bool:
    """Send ``sig`` to the container's command (PID 2; as a runtime does), not to bwrap (which would die of a
    SIGTERM at once) nor to the namespace's PID 1 (bwrap's reaper has no handler, so the kernel drops every
    signal but SIGKILL sent to it from outside).  Returns False when the command is not running (yet)."""
    import psutil

    main = main_process(bwrap_pid)
    if main is None:
        return False
    try:
        main.send_signal(sig)
    except psutil.Error:
        return False
    return True


def stop_container(
    proc: subprocess.Popen, pidns: str | None = None, grace: float = 30.0, sig: int = signal.SIGTERM
) -> int | None:
    """A runtime's stop: ``sig`` to the command, SIGKILL to the whole container after ``grace`` seconds (or at
    once when the command is not running), then wait until bwrap and every process of the container's PID
    namespace have exited.  Returns bwrap's exit status (the command's; 128+n when signal n killed it)."""
    pidns = pidns or pid_namespace(proc.pid, timeout=0)
    if proc.poll() is None:
        if signal_container(proc.pid, sig):
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            init = container_init(proc.pid)
            for pid in [init.pid] if init is not None else []:
                try:
                    os.kill(pid, signal.SIGKILL)  # the kernel kills the namespace, then bwrap exits
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()  # no namespace yet (or a stuck bwrap): its reaper follows it (parent-death signal)
                proc.wait()
    reap(pidns)
    return proc.returncode


def image_mode() -> bool:
    """True when the e2e suites run pods (and the operator) from the built images: ``NAIAD_E2E_IMAGES=1``."""
    return os.environ.get("NAIAD_E2E_IMAGES", "").lower() in ("1", "true", "yes")

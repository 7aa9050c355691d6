"""Stand-in container runtime for kwok nodes: runs pods as local processes.

kwok fakes kubelets: it sets a pod's phase to Running and gives it an IP, but
runs nothing.  ``PodRunner`` watches the pods bound to the given node(s) (the
simulated GPU node of e2e/cluster.py) and, for every pod that kwok has marked
Running with a pod IP, starts the container's ``command`` + ``args`` as a real
local process (the image is ignored unless image mode is on, below), then reports container state and
readiness back to the API server the way a kubelet would.  When the pod is
deleted (deletionTimestamp set, or the object gone) the process group gets
SIGTERM, then SIGKILL after min(terminationGracePeriodSeconds, grace_cap).

What is emulated (kubelet semantics, simplified):

* pod IP: kwok assigns it from the node's spec.podCIDR (198.18.0.0/24 by
  default, made local by e2e/podnet.py, so each pod has its own address on
  this host).
  The pod IP reaches the process through the Downward API exactly as in a real
  cluster (``env: [{name: POD_IP, valueFrom: {fieldRef: {fieldPath:
  status.podIP}}}]`` and ``$(POD_IP)`` in command/args), or through the
  ``extra_args`` hook (see ``bind_to_pod_ip``) for programs that bind
  0.0.0.0 by default, which would collide on a shared host.
* env: value, $(VAR) expansion, valueFrom fieldRef / configMapKeyRef /
  secretKeyRef / resourceFieldRef (limits/requests), envFrom configMap/secret.
  The runner's own environment (PATH, virtualenv) is inherited underneath.
* volumes: no mount namespaces.  Each volumeMount's mountPath is mapped to a
  local directory and every argv element / env value / workingDir that is, or
  starts with, a mountPath (also ``--flag=/mount/...``) is rewritten to the
  local path.  Local directories: the ``volumes`` mapping given to PodRunner
  (key: PVC claimName, hostPath path or volume name); otherwise a hostPath is
  used as is, a PVC gets ``workdir/pvc/<namespace>/<claim>`` (persists across
  pods like a real PV), emptyDir a per-pod dir, configMap/secret volumes are
  materialised from the API into a per-pod dir.  subPath is honoured.
* readiness: kwok (via e2e/kwok-stages.yaml) leaves these pods Ready=False.
  The runner sets the container running once the process is started and sets
  Ready/ContainersReady=True only when the readinessProbe succeeds (httpGet,
  tcpSocket, exec; grpc probes are treated as tcpSocket), or right after start
  if the container has no readinessProbe - as a kubelet does.  startupProbe
  gates readiness; livenessProbe failures restart the process.  Probe timing
  (initialDelaySeconds, periodSeconds, timeoutSeconds, success/failure
  thresholds) follows the pod spec; ``max_probe_period`` can cap periodSeconds.
  So EndpointSlices (real endpointslice controller) only list a pod as ready
  once its server really answers.
* exits: restartPolicy Always/OnFailure restart the process with exponential
  backoff (1s doubling, capped at 10s; the kubelet uses 10s..5min) and bump
  restartCount; otherwise the pod phase becomes Succeeded/Failed.
* only the first container is run by default (``containers="all"`` runs every
  container); containers that are not run are reported running and ready.
  Init containers are reported Completed without running.

* image mode (``images=ImageStore``, see e2e/images.py): a container whose
  ``image`` is one of the built images runs from that unpacked image under
  bubblewrap instead: read-only root, command/args over ENTRYPOINT/CMD, the
  image's env under the container's (no host env), volumes bound at their
  mount paths (no path rewriting), the image's user or securityContext's
  runAsUser/runAsGroup (runAsNonRoot enforced), exec probes run inside the
  running container.  Each container has a PID namespace of its own: SIGTERM
  goes to its command (PID 2), SIGKILL to the namespace after the grace period,
  and a stop or a restart waits until no process of the container is left.
  A pod that gets a deleted pod's IP starts once that pod's processes are gone.
  Other images still run as host processes (e.g. a test's client pod).

Not emulated: resource limits/cgroups, network isolation (every pod
shares the runner's network namespace), service env vars / in-cluster
credentials, postStart/preStop hooks, ``kubectl logs/exec`` (logs are files:
``PodRunner.log_path``).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from e2e.images import (
    ContainerSpec,
    ImageError,
    ImageStore,
    Mount,
    exec_argv,
    pid_namespace,
    reap,
    stop_container,
)

log = logging.getLogger("naiad.e2e.podrunner")

E2E_DIR = Path(__file__).resolve().parent
WORK_ROOT = E2E_DIR / ".work"

ExtraArgs = Callable[[dict, dict, str], Sequence[str]]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ----------------------------------------------------------------- helpers usable as hooks
def bind_to_pod_ip(pod: dict, container: dict, pod_ip: str) -> list[str]:
    """``extra_args`` hook for Naiad: append ``--http-address IP --grpc-address IP``
    to a ``naiad serve`` command unless it already sets them."""
    argv = list(container.get("command") or []) + list(container.get("args") or [])
    if "serve" not in argv:
        return []
    extra: list[str] = []
    for flag in ("--http-address", "--grpc-address"):
        if not any(a == flag or a.startswith(flag + "=") for a in argv):
            extra += [flag, pod_ip]
    return extra


def expand(s: str, env: Mapping[str, str]) -> str:
    """Kubernetes $(VAR) expansion: defined vars are replaced, $$ escapes a $,
    undefined references are left as written."""
    out: list[str] = []
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c == "$" and i + 1 < n:
            nxt = s[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                j = s.find(")", i + 2)
                if j != -1:
                    name = s[i + 2 : j]
                    if name in env:
                        out.append(env[name])
                    else:
                        out.append(s[i : j + 1])
                    i = j + 1
                    continue
        out.append(c)
        i += 1
    return "".join(out)


# ----------------------------------------------------------------- minimal API client
class _Api:
    """Tiny client for the few calls the runner makes (stdlib only; auth from
    the kubeconfig via the ``kubernetes`` package's loader, so token/exec/cert
    kubeconfigs all work)."""

    def __init__(self, kubeconfig: str) -> None:
        from kubernetes import client as kclient
        from kubernetes import config as kconfig

        cfg = kclient.Configuration()
        kconfig.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        self.host = cfg.host.rstrip("/")
        ctx = (
            ssl.create_default_context(cafile=cfg.ssl_ca_cert)
            if cfg.ssl_ca_cert
            else ssl.create_default_context()
        )
        if not cfg.verify_ssl:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if cfg.cert_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        self.ctx = ctx
        self.headers = {"Accept": "application/json"}
        for key in ("authorization", "BearerToken"):
            try:
                auth = cfg.get_api_key_with_prefix(key)
            except Exception:
                auth = None
            if auth:
                if not auth.lower().startswith("bearer "):
                    auth = "Bearer " + auth
                self.headers["Authorization"] = auth
                break

    def request(
        self, method: str, path: str, body=None, content_type: str = "application/json", timeout: float = 30
    ):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.host + path, data=data, method=method, headers=dict(self.headers))
        if data is not None:
            req.add_header("Content-Type", content_type)
        return urllib.request.urlopen(req, context=self.ctx, timeout=timeout)

    def get_json(self, path: str, timeout: float = 30):
        with self.request("GET", path, timeout=timeout) as r:
            return json.loads(r.read())

    def patch_status(self, ns: str, name: str, status: dict) -> None:
        with self.request(
            "PATCH",
            f"/api/v1/namespaces/{ns}/pods/{name}/status",
            {"status": status},
            content_type="application/strategic-merge-patch+json",
        ):
            pass


# ----------------------------------------------------------------- per container process
@dataclass
class ProcessInfo:
    """Snapshot of one running (or last run) container process."""

    namespace: str
    pod: str
    uid: str
    container: str
    pod_ip: str
    argv: list[str]
    cwd: str
    pid: int | None
    running: bool
    ready: bool
    restart_count: int
    log_path: Path
    exit_code: int | None = None
    image_id: str = ""  # the unpacked image the container runs from; "" for a host process


@dataclass
class _Probe:
    spec: dict
    kind: str  # readiness | liveness | startup
    successes: int = 0
    failures: int = 0
    next_at: float = 0.0
    result: bool | None = None  # last settled result

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds") or 10)

    @property
    def timeout(self) -> float:
        return float(self.spec.get("timeoutSeconds") or 1)

    @property
    def success_threshold(self) -> int:
        return int(self.spec.get("successThreshold") or 1)

    @property
    def failure_threshold(self) -> int:
        return int(self.spec.get("failureThreshold") or 3)


@dataclass
class _Container:
    spec: dict
    run: bool
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    started_at: str | None = None
    restart_count: int = 0
    last_terminated: dict | None = None
    ready: bool = False
    started: bool = False
    exit_code: int | None = None
    done: bool = False  # terminated for good (no restart)
    backoff_until: float = 0.0
    backoff: float = 0.0
    waiting_reason: str | None = "ContainerCreating"
    waiting_message: str | None = None
    probes: dict[str, _Probe] = field(default_factory=dict)
    image: ContainerSpec | None = None  # image mode: the container as started from its unpacked image
    pidns: str | None = None  # image mode: the running container's PID namespace (e2e/images.py)

    @property
    def name(self) -> str:
        return self.spec["name"]


class _PodWorker(threading.Thread):
    """Runs and supervises the processes of one pod."""

    def __init__(self, runner: PodRunner, pod: dict) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"podrunner-{meta['namespace']}/{meta['name']}", daemon=True)
        self.runner = runner
        self.pod = pod
        self.ns = meta["namespace"]
        self.name = meta["name"]
        self.uid = meta["uid"]
        self.pod_ip = pod["status"]["podIP"]
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.dir = runner.workdir / "pods" / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.containers: list[_Container] = []
        self.finished = threading.Event()  # all processes gone after stop
        self.predecessors: list[
            _PodWorker
        ] = []  # workers of older pods with this pod IP: waited for before start
        self.phase = "Running"
        self.error: str | None = None
        self._last_status: str | None = None

    # ------------------------------------------------------------ setup
    def _resolve_volumes(self) -> dict[str, Path]:
        """volume name -> local dir."""
        vols: dict[str, Path] = {}
        m = self.runner.volumes
        for v in self.pod["spec"].get("volumes") or []:
            name = v["name"]
            local: Path | None = None
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                src = m.get(claim) or m.get(f"pvc:{claim}") or m.get(name)
                local = Path(src) if src else self.runner.workdir / "pvc" / self.ns / claim
            elif "hostPath" in v:
                hp = v["hostPath"]["path"]
                src = m.get(hp) or m.get(f"hostPath:{hp}") or m.get(name)
                local = Path(src) if src else Path(hp)
            elif name in m:
                local = Path(m[name])
            elif "configMap" in v or "secret" in v:
                local = self.dir / "volumes" / name
                self._materialise(v, local)
            else:  # emptyDir and anything else: a fresh per-pod dir, world-writable as the kubelet makes it
                local = self.dir / "volumes" / name
                local.mkdir(parents=True, exist_ok=True)
                local.chmod(0o777)
            local.mkdir(parents=True, exist_ok=True)
            vols[name] = local
        return vols

    def _materialise(self, v: dict, dest: Path) -> None:
        dest.mkdir(parents=True, exist_ok=True)
        if "configMap" in v:
            src = v["configMap"]
            obj = self.runner._get(
                f"/api/v1/namespaces/{self.ns}/configmaps/{src['name']}", src.get("optional")
            )
            data = {k: s.encode() for k, s in (obj or {}).get("data", {}).items()}
            data.update({k: base64.b64decode(s) for k, s in (obj or {}).get("binaryData", {}).items()})
        else:
            src = v["secret"]
            obj = self.runner._get(
                f"/api/v1/namespaces/{self.ns}/secrets/{src['secretName']}", src.get("optional")
            )
            data = {k: base64.b64decode(s) for k, s in (obj or {}).get("data", {}).items()}
        items = src.get("items")
        default_mode = src.get("defaultMode")
        default_mode = 0o644 if default_mode is None else int(default_mode)
        pairs = (
            [(it["key"], it["path"], it.get("mode")) for it in items]
            if items
            else [(k, k, None) for k in data]
        )
        # as the kubelet writes them: root-owned with defaultMode/mode, group fsGroup (and group-readable) if set
        fs_group = (self.pod["spec"].get("securityContext") or {}).get("fsGroup")
        for key, rel, mode in pairs:
            if key in data:
                p = dest / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data[key])
                mode = default_mode if mode is None else int(mode)
                if fs_group is not None:
                    os.chown(p, -1, int(fs_group))
                    mode |= 0o040
                p.chmod(mode)

    def _env_for(self, c: dict) -> dict[str, str]:
        env: dict[str, str] = {}  # the container's own env, for $(VAR) expansion
        for ef in c.get("envFrom") or []:
            prefix = ef.get("prefix", "")
            if "configMapRef" in ef:
                r = ef["configMapRef"]
                obj = self.runner._get(
                    f"/api/v1/namespaces/{self.ns}/configmaps/{r['name']}", r.get("optional")
                )
                for k, s in (obj or {}).get("data", {}).items():
                    env[prefix + k] = s
            elif "secretRef" in ef:
                r = ef["secretRef"]
                obj = self.runner._get(f"/api/v1/namespaces/{self.ns}/secrets/{r['name']}", r.get("optional"))
                for k, s in (obj or {}).get("data", {}).items():
                    env[prefix + k] = base64.b64decode(s).decode(errors="replace")
        for e in c.get("env") or []:
            name = e["name"]
            if "value" in e:
                env[name] = expand(e.get("value") or "", env)
                continue
            vf = e.get("valueFrom")
            if not vf:
                env[name] = ""
                continue
            val: str | None = None
            if "fieldRef" in vf:
                val = self._field(vf["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in vf:
                val = self._resource(c, vf["resourceFieldRef"])
            elif "configMapKeyRef" in vf:
                r = vf["configMapKeyRef"]
                obj = self.runner._get(
                    f"/api/v1/namespaces/{self.ns}/configmaps/{r['name']}", r.get("optional")
                )
                val = (obj or {}).get("data", {}).get(r["key"])
            elif "secretKeyRef" in vf:
                r = vf["secretKeyRef"]
                obj = self.runner._get(f"/api/v1/namespaces/{self.ns}/secrets/{r['name']}", r.get("optional"))
                raw = (obj or {}).get("data", {}).get(r["key"])
                val = base64.b64decode(raw).decode(errors="replace") if raw is not None else None
            if val is not None:
                env[name] = val
        return env

    def _field(self, path: str) -> str:
        meta, spec, st = self.pod["metadata"], self.pod["spec"], self.pod.get("status", {})
        simple = {
            "metadata.name": meta.get("name"),
            "metadata.namespace": meta.get("namespace"),
            "metadata.uid": meta.get("uid"),
            "spec.nodeName": spec.get("nodeName"),
            "spec.serviceAccountName": spec.get("serviceAccountName"),
            "status.hostIP": st.get("hostIP"),
            "status.podIP": st.get("podIP"),
            "status.podIPs": ",".join(p["ip"] for p in st.get("podIPs") or []),
            "status.hostIPs": ",".join(p["ip"] for p in st.get("hostIPs") or []),
        }
        if path in simple:
            return simple[path] or ""
        mm = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if mm:
            return (meta.get(mm.group(1)) or {}).get(mm.group(2), "")
        if path in ("metadata.labels", "metadata.annotations"):
            d = meta.get(path.split(".")[1]) or {}
            return "\n".join(f'{k}="{v}"' for k, v in sorted(d.items()))
        return ""

    @staticmethod
    def _resource(c: dict, ref: dict) -> str:
        kind, _, res = ref["resource"].partition(".")
        val = ((c.get("resources") or {}).get(kind) or {}).get(res)
        return str(val) if val is not None else "0"

    def _prepare(self, c: _Container, vols: dict[str, Path]) -> None:
        spec = c.spec
        env = self._env_for(spec)
        mounts: list[tuple[str, Path]] = []
        read_only: dict[str, bool] = {}
        for vm in spec.get("volumeMounts") or []:
            base = vols.get(vm["name"])
            if base is None:
                continue
            local = base / vm["subPath"] if vm.get("subPath") else base
            if vm.get("subPath"):
                local.mkdir(parents=True, exist_ok=True)
            mounts.append((vm["mountPath"].rstrip("/") or "/", local))
            read_only[mounts[-1][0]] = bool(vm.get("readOnly"))
        mounts.sort(key=lambda m: len(m[0]), reverse=True)
        for kind in ("readiness", "liveness", "startup"):
            p = spec.get(f"{kind}Probe")
            if p:
                c.probes[kind] = _Probe(p, kind)
        c.log_path = self.runner.workdir / "logs" / f"{self.ns}_{self.name}_{self.uid[:8]}" / f"{c.name}.log"
        c.log_path.parent.mkdir(parents=True, exist_ok=True)
        images = self.runner.images
        if images is not None and images.knows(spec.get("image") or ""):
            self._prepare_image(c, env, mounts, read_only)
            return

        def remap(s: str) -> str:
            for mp, local in mounts:
                if s == mp or s.startswith(mp + "/"):
                    return str(local) + s[len(mp) :]
                if s.startswith("--") and "=" in s:
                    flag, _, val = s.partition("=")
                    if val == mp or val.startswith(mp + "/"):
                        return f"{flag}={local}{val[len(mp) :]}"
            return s

        argv = [expand(a, env) for a in list(spec.get("command") or []) + list(spec.get("args") or [])]
        if self.runner.extra_args is not None:
            argv += list(self.runner.extra_args(self.pod, spec, self.pod_ip))
        argv = [remap(a) for a in argv]
        if argv and argv[0] in self.runner.executables:
            argv[0] = str(self.runner.executables[argv[0]])
        full_env = dict(os.environ)
        full_env.update(self.runner.extra_env)
        full_env["HOSTNAME"] = self.name
        full_env.update({k: remap(v) for k, v in env.items()})
        wd = spec.get("workingDir")
        cwd = remap(wd) if wd else ""
        if not cwd or not os.path.isdir(cwd):
            cwd = str(self.dir)
        c.argv, c.env, c.cwd = argv, full_env, cwd
        self._remap = remap

    def _prepare_image(
        self, c: _Container, env: dict[str, str], mounts: list[tuple[str, Path]], read_only: dict[str, bool]
    ) -> None:
        """Image mode: the container runs from its unpacked image (see e2e/images.py), volumes at their paths."""
        spec = c.spec
        try:
            image = self.runner.images.get(spec["image"])
        except ImageError as e:
            c.waiting_reason, c.waiting_message = "ErrImagePull", str(e)
            return
        command = [expand(a, env) for a in spec.get("command") or []] or None
        args = [expand(a, env) for a in spec.get("args") or []] if "args" in spec else None
        if self.runner.extra_args is not None:
            extra = list(self.runner.extra_args(self.pod, spec, self.pod_ip))
            if extra:
                args = [*(image.cmd if args is None and command is None else args or []), *extra]
        pod_sc = self.pod["spec"].get("securityContext") or {}
        sc = {**pod_sc, **(spec.get("securityContext") or {})}
        binds = [Mount(Path(local), mp, read_only.get(mp, False)) for mp, local in mounts]
        binds += [Mount(Path(src), dst, True) for dst, src in self.runner.image_binds.items()]
        container = ContainerSpec(
            image,
            command=command,
            args=args,
            env={**self.runner.extra_env, **env},
            mounts=binds,
            working_dir=spec.get("workingDir") or None,
            run_as_user=sc.get("runAsUser"),
            run_as_group=sc.get("runAsGroup"),
            supplemental_groups=[
                *([pod_sc["fsGroup"]] if pod_sc.get("fsGroup") is not None else []),
                *(pod_sc.get("supplementalGroups") or []),
            ],
            hostname=self.name,
        )
        if sc.get("runAsNonRoot") and container.user()[0] == 0:
            c.waiting_reason = "CreateContainerConfigError"
            c.waiting_message = "container has runAsNonRoot and image will run as root"
            return
        try:
            c.argv = container.argv()
        except (ImageError, OSError) as e:
            c.waiting_reason, c.waiting_message = "CreateContainerError", str(e)
            return
        c.image, c.env, c.cwd = container, container.full_env(), str(self.dir)
        self._remap = lambda s: s

    # ------------------------------------------------------------ processes
    def _start_proc(self, c: _Container) -> None:
        if not c.argv:
            if not c.waiting_message:
                c.waiting_reason, c.waiting_message = (
                    "CreateContainerError",
                    "no command/args: images are not run",
                )
            self.error = c.waiting_message
            return
        with open(c.log_path, "ab") as logf:
            logf.write(f"=== {_now()} start (restart {c.restart_count}): {c.argv}\n".encode())
            logf.flush()
            try:
                c.proc = subprocess.Popen(
                    c.argv,
                    env=c.env,
                    cwd=c.cwd,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as e:
                c.proc = None
                c.waiting_reason, c.waiting_message = "RunContainerError", str(e)
                c.exit_code = 128
                self._on_exit(c, 128, start_failed=True)
                return
        if c.image is not None:
            c.pidns = pid_namespace(c.proc.pid)
        c.started_at = _now()
        c.waiting_reason = c.waiting_message = None
        c.started = "startup" not in c.probes
        c.exit_code = None
        t = time.monotonic()
        for p in c.probes.values():
            p.successes = p.failures = 0
            p.result = None
            p.next_at = t + float(p.spec.get("initialDelaySeconds") or 0)
        c.ready = "readiness" not in c.probes and c.started
        self.runner._event("started", self, c)
        log.info("%s/%s[%s] started pid %s: %s", self.ns, self.name, c.name, c.proc.pid, c.argv)

    def _kill(self, c: _Container, grace: float) -> None:
        """Stop the container and return only once every process of it has exited (its ports are free)."""
        p = c.proc
        if p is None:
            return
        if c.image is not None:
            # SIGTERM to the command, SIGKILL to its PID namespace after the grace period, wait until it is empty
            stop_container(p, c.pidns, grace)
            c.pidns = None
            return
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the leader is not reaped yet: its pid is still the group's
            except ProcessLookupError:
                pass
            p.wait()

    def _on_exit(self, c: _Container, code: int, start_failed: bool = False) -> None:
        c.last_terminated = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.started_at or _now(),
            "finishedAt": _now(),
        }
        c.exit_code = code
        c.ready = False
        c.started = False
        policy = self.pod["spec"].get("restartPolicy", "Always")
        restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        self.runner._event("exited", self, c)
        log.info("%s/%s[%s] exited %s (restart=%s)", self.ns, self.name, c.name, code, restart)
        if restart:
            c.backoff = min(max(c.backoff * 2, 1.0), 10.0)
            c.backoff_until = time.monotonic() + c.backoff
            c.restart_count += 1
            c.waiting_reason = "CrashLoopBackOff"
            c.waiting_message = f"back-off {c.backoff:.0f}s restarting failed container"
        else:
            c.done = True

    # ------------------------------------------------------------ probes
    def _probe_once(self, c: _Container, spec: dict, timeout: float) -> bool:
        def port_of(p):
            if isinstance(p, int) or (isinstance(p, str) and p.isdigit()):
                return int(p)
            for cp in c.spec.get("ports") or []:
                if cp.get("name") == p:
                    return int(cp["containerPort"])
            raise ValueError(f"unknown named port {p!r}")

        try:
            if "httpGet" in spec:
                h = spec["httpGet"]
                scheme = (h.get("scheme") or "HTTP").lower()
                host = h.get("host") or self.pod_ip
                path = h.get("path") or "/"
                url = f"{scheme}://{host}:{port_of(h['port'])}{path if path.startswith('/') else '/' + path}"
                req = urllib.request.Request(
                    url, headers={x["name"]: x["value"] for x in h.get("httpHeaders") or []}
                )
                req.add_header("User-Agent", "kube-probe/naiad-e2e")
                ctx = ssl._create_unverified_context() if scheme == "https" else None
                try:
                    with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
                        return 200 <= r.status < 400
                except urllib.error.HTTPError as e:
                    return 200 <= e.code < 400
            if "tcpSocket" in spec or "grpc" in spec:
                s = spec.get("tcpSocket") or spec["grpc"]
                host = s.get("host") or self.pod_ip
                with socket.create_connection((host, port_of(s["port"])), timeout=timeout):
                    return True
            if "exec" in spec:
                argv = [self._remap(expand(a, c.env)) for a in spec["exec"].get("command") or []]
                if c.image is not None and c.proc is not None:  # inside the running container
                    argv = exec_argv(c.image, c.proc.pid, argv)
                r = subprocess.run(
                    argv,
                    env=c.env,
                    cwd=c.cwd,
                    timeout=timeout,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                return r.returncode == 0
        except Exception:
            return False
        return True

    def _run_probes(self, c: _Container) -> None:
        now = time.monotonic()
        cap = self.runner.max_probe_period
        for kind in ("startup", "liveness", "readiness"):
            p = c.probes.get(kind)
            if p is None or now < p.next_at:
                continue
            if kind != "startup" and not c.started:
                continue
            if kind == "startup" and c.started:
                continue
            ok = self._probe_once(c, p.spec, p.timeout)
            period = min(p.period, cap) if cap else p.period
            p.next_at = time.monotonic() + period
            if ok:
                p.successes += 1
                p.failures = 0
                if p.successes >= (1 if kind != "readiness" else p.success_threshold):
                    p.result = True
            else:
                p.failures += 1
                p.successes = 0
                if p.failures >= p.failure_threshold:
                    p.result = False
            if kind == "startup" and p.result:
                c.started = True
                c.ready = "readiness" not in c.probes
            elif kind in ("startup", "liveness") and p.result is False:
                log.info("%s/%s[%s] %s probe failed: restarting", self.ns, self.name, c.name, kind)
                self._kill(c, self._grace())
                code = c.proc.returncode if c.proc else 137
                c.proc = None
                self._on_exit(c, code if code is not None else 137)
                return
            elif kind == "readiness" and p.result is not None:
                c.ready = bool(p.result)

    # ------------------------------------------------------------ status
    def _container_status(self, c: _Container) -> dict:
        image = c.spec.get("image", "")
        st: dict = {
            "name": c.name,
            "image": image,
            "imageID": f"docker-archive://sha256:{c.image.image.image_id}" if c.image is not None else "",
            "restartCount": c.restart_count,
            "ready": c.ready if c.run else True,
            "started": c.started if c.run else True,
        }
        if not c.run:
            st["state"] = {"running": {"startedAt": self.pod.get("status", {}).get("startTime") or _now()}}
        elif c.proc is not None and c.proc.poll() is None:
            st["state"] = {"running": {"startedAt": c.started_at}}
            st["containerID"] = f"naiad-e2e://{c.proc.pid}"
        elif c.done and c.last_terminated:
            st["state"] = {"terminated": dict(c.last_terminated)}
        else:
            w = {"reason": c.waiting_reason or "ContainerCreating"}
            if c.waiting_message:
                w["message"] = c.waiting_message
            st["state"] = {"waiting": w}
        if c.last_terminated and not c.done:
            st["lastState"] = {"terminated": dict(c.last_terminated)}
        return st

    def _push_status(self, force: bool = False) -> None:
        statuses = [self._container_status(c) for c in self.containers]
        all_ready = all(s["ready"] for s in statuses) and self.phase == "Running"
        unready = [s["name"] for s in statuses if not s["ready"]]
        status: dict = {"containerStatuses": statuses}
        cond_ready = "True" if all_ready else "False"
        key = json.dumps(
            [self.phase, cond_ready, [{k: v for k, v in s.items()} for s in statuses]], sort_keys=True
        )
        if key == self._last_status and not force:
            return
        conds = []
        for t in ("Ready", "ContainersReady"):
            cond = {"type": t, "status": cond_ready, "lastProbeTime": None}
            if all_ready:
                cond.update(reason=None, message=None)
            else:
                cond.update(
                    reason="PodCompleted" if self.phase != "Running" else "ContainersNotReady",
                    message=f"containers with unready status: [{' '.join(unready)}]",
                )
            prev = self._prev_condition(t)
            if prev is None or prev.get("status") != cond_ready:
                cond["lastTransitionTime"] = _now()
            conds.append(cond)
        status["conditions"] = conds
        if self.phase != "Running":
            status["phase"] = self.phase
        try:
            self.runner._api.patch_status(self.ns, self.name, status)
            self._last_status = key
            for cond in conds:
                self._set_prev_condition(cond)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                self.stop_event.set()
            else:
                log.warning("%s/%s: status patch failed: %s %s", self.ns, self.name, e, e.read()[:300])
        except Exception as e:  # API hiccup: retried on the next loop
            log.warning("%s/%s: status patch failed: %s", self.ns, self.name, e)

    def _prev_condition(self, t: str) -> dict | None:
        for cond in self.pod.get("status", {}).get("conditions") or []:
            if cond.get("type") == t:
                return cond
        return None

    def _set_prev_condition(self, cond: dict) -> None:
        conds = self.pod.setdefault("status", {}).setdefault("conditions", [])
        for i, old in enumerate(conds):
            if old.get("type") == cond["type"]:
                conds[i] = {**old, "status": cond["status"]}
                return
        conds.append({"type": cond["type"], "status": cond["status"]})

    def _grace(self) -> float:
        g = self.pod["spec"].get("terminationGracePeriodSeconds")
        g = 30.0 if g is None else float(g)
        return max(0.0, min(g, self.runner.grace_cap))

    # ------------------------------------------------------------ main loop
    def run(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            specs = self.pod["spec"].get("containers") or []
            run_all = self.runner.containers == "all"
            self.containers = [_Container(s, run=run_all or i == 0) for i, s in enumerate(specs)]
            vols = self._resolve_volumes()
            for c in self.containers:
                if c.run:
                    self._prepare(c, vols)
            # kwok hands a deleted pod's IP to the next pod at once: start only when the older pod's processes
            # have exited (and its ports on this IP are free), as a kubelet's sandbox gets a fresh network.
            for older in self.predecessors:
                if not older.finished.wait(self.runner.grace_cap + 15):
                    log.warning(
                        "%s/%s: pod %s/%s still holds %s",
                        self.ns,
                        self.name,
                        older.ns,
                        older.name,
                        self.pod_ip,
                    )
            self.predecessors = []
            with self.lock:
                for c in self.containers:
                    if c.run and not self.stop_event.is_set():
                        self._start_proc(c)
            self._push_status(force=True)
            while not self.stop_event.wait(self.runner.poll_interval):
                with self.lock:
                    for c in self.containers:
                        if not c.run or c.done:
                            continue
                        if c.proc is not None:
                            code = c.proc.poll()
                            if code is not None:
                                # bwrap gone (its command exited, or bwrap was killed): nothing of the container
                                # may outlive it, or a restart could not bind the pod IP's ports
                                reap(c.pidns)
                                c.proc, c.pidns = None, None
                                self._on_exit(c, code)
                            else:
                                self._run_probes(c)
                        elif c.backoff_until and time.monotonic() >= c.backoff_until and c.argv:
                            c.backoff_until = 0.0
                            self._start_proc(c)
                    ran = [c for c in self.containers if c.run]
                    if ran and all(c.done for c in ran):
                        self.phase = "Succeeded" if all(c.exit_code == 0 for c in ran) else "Failed"
                self._push_status()
                if self.phase != "Running":
                    break
        except Exception:
            log.exception("%s/%s: pod worker crashed", self.ns, self.name)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        grace = self._grace()
        with self.lock:
            for c in self.containers:
                if c.proc is not None:
                    self._kill(c, grace)
                    self.runner._event("stopped", self, c)
                    log.info("%s/%s[%s] stopped", self.ns, self.name, c.name)
        if not self.runner.keep_workdir:
            shutil.rmtree(self.dir / "volumes", ignore_errors=True)
        self.finished.set()

    def info(self) -> list[ProcessInfo]:
        out = []
        for c in self.containers:
            if not c.run:
                continue
            p = c.proc
            running = p is not None and p.poll() is None
            out.append(
                ProcessInfo(
                    namespace=self.ns,
                    pod=self.name,
                    uid=self.uid,
                    container=c.name,
                    pod_ip=self.pod_ip,
                    argv=list(c.argv),
                    cwd=c.cwd,
                    pid=p.pid if p is not None else None,
                    running=running,
                    ready=c.ready,
                    restart_count=c.restart_count,
                    log_path=c.log_path or Path(os.devnull),
                    exit_code=c.exit_code,
                    image_id=c.image.image.image_id if c.image is not None else "",
                )
            )
        return out


# ----------------------------------------------------------------- the runner
class PodRunner:
    """Run the pods bound to ``node_names`` as local processes.

    ``start()`` lists and then watches pods (one background thread) and returns
    immediately; ``stop()`` stops the watch and every process.  Also a context
    manager.  Parameters:

    kubeconfig        path to the cluster's kubeconfig (KwokCluster.kubeconfig)
    node_names        nodes whose pods are run (default: the GPU node of cluster.py)
    volumes           {PVC claimName | hostPath path | volume name: local dir}
    workdir           logs, per-pod dirs, default PVC dirs (default: tmp dir in e2e/.work)
    executables       {argv[0] as in the pod spec: local executable}, e.g. {"naiad": ".venv/bin/naiad"}
    extra_args        hook (pod, container, pod_ip) -> extra argv, e.g. bind_to_pod_ip
    extra_env         env added under the container's own env (e.g. {"CUDA_VISIBLE_DEVICES": ""})
    containers        "first" (default) or "all"
    images            an e2e.images.ImageStore: containers whose ``image`` it knows run from that unpacked
                      image (bubblewrap) instead of as host processes; other images still run on the host
    image_binds       {path in the container: local dir} bound read-only into every image container (what a
                      real node would have to provide, e.g. a model repository named by a plain path)
    max_probe_period  cap on probes' periodSeconds (None: as in the spec)
    grace_cap         cap in seconds on terminationGracePeriodSeconds when stopping
    """

    def __init__(
        self,
        kubeconfig: str | os.PathLike,
        node_names: Iterable[str] = ("gpu-node-0",),
        *,
        volumes: Mapping[str, str | os.PathLike] | None = None,
        workdir: str | os.PathLike | None = None,
        executables: Mapping[str, str | os.PathLike] | None = None,
        extra_args: ExtraArgs | None = None,
        extra_env: Mapping[str, str] | None = None,
        containers: str = "first",
        max_probe_period: float | None = None,
        grace_cap: float = 10.0,
        poll_interval: float = 0.2,
        keep_workdir: bool = False,
        images: ImageStore | None = None,
        image_binds: Mapping[str, str | os.PathLike] | None = None,
    ) -> None:
        if containers not in ("first", "all"):
            raise ValueError("containers must be 'first' or 'all'")
        self.kubeconfig = str(kubeconfig)
        self.node_names = set(node_names)
        self.volumes = {str(k): str(v) for k, v in (volumes or {}).items()}
        self._own_workdir = workdir is None
        if workdir is None:
            WORK_ROOT.mkdir(parents=True, exist_ok=True)
            workdir = tempfile.mkdtemp(prefix="podrunner-", dir=WORK_ROOT)
        self.workdir = Path(workdir).resolve()
        self.executables = {str(k): str(v) for k, v in (executables or {}).items()}
        self.extra_args = extra_args
        self.extra_env = dict(extra_env or {})
        self.containers = containers
        self.max_probe_period = max_probe_period
        self.grace_cap = grace_cap
        self.poll_interval = poll_interval
        self.keep_workdir = keep_workdir
        self.images = images
        self.image_binds = {str(k): str(v) for k, v in (image_binds or {}).items()}
        self._api: _Api | None = None
        self._workers: dict[str, _PodWorker] = {}  # uid -> worker
        self._stopping: list[_PodWorker] = []  # workers of deleted pods, until their processes have exited
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._synced = threading.Event()
        self.events: list[tuple[float, str, str, str, str]] = []  # (time, what, ns, pod, container)
        self._cond = threading.Condition()

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 30) -> PodRunner:
        """Start watching; returns once the initial pod list has been handled."""
        if self._thread is not None:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._api = _Api(self.kubeconfig)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch_loop, name="podrunner-watch", daemon=True)
        self._thread.start()
        if not self._synced.wait(timeout):
            raise TimeoutError("pod runner: initial pod list not received")
        return self

    def stop(self) -> None:
        """Stop watching and terminate every process (waits for them)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
            self._thread = None
        with self._lock:
            workers = [*self._workers.values(), *self._stopping]
            self._workers.clear()
            self._stopping = []
        for w in workers:
            w.stop_event.set()
        for w in workers:
            w.finished.wait(timeout=self.grace_cap + 15)
        if self._own_workdir and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PodRunner:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ queries
    def processes(self) -> list[ProcessInfo]:
        """Every pod container the runner currently manages (running or not)."""
        with self._lock:
            workers = list(self._workers.values())
        return [i for w in workers for i in w.info()]

    def running(self, namespace: str | None = None) -> list[ProcessInfo]:
        return [p for p in self.processes() if p.running and (namespace is None or p.namespace == namespace)]

    def get(self, namespace: str, pod: str, container: str | None = None) -> ProcessInfo | None:
        for p in self.processes():
            if p.namespace == namespace and p.pod == pod and (container is None or p.container == container):
                return p
        return None

    def wait_for(
        self, predicate: Callable[[list[ProcessInfo]], bool], timeout: float = 60, what: str = "condition"
    ) -> list[ProcessInfo]:
        """Poll processes() until predicate(processes) is true; returns them."""
        deadline = time.monotonic() + timeout
        while True:
            procs = self.processes()
            if predicate(procs):
                return procs
            if time.monotonic() > deadline:
                raise TimeoutError(f"pod runner: timed out waiting for {what}; processes: {procs}")
            time.sleep(0.2)

    def log_path(self, namespace: str, pod: str, container: str | None = None) -> Path | None:
        p = self.get(namespace, pod, container)
        return p.log_path if p else None

    def logs(self, namespace: str, pod: str, container: str | None = None) -> str:
        """Output of the pod's process (like kubectl logs); '' if unknown."""
        lp = self.log_path(namespace, pod, container)
        if lp is None:
            d = list((self.workdir / "logs").glob(f"{namespace}_{pod}_*"))
            if not d:
                return ""
            files = sorted(d[-1].glob(f"{container or '*'}.log"))
            lp = files[0] if files else None
        return lp.read_text(errors="replace") if lp and lp.exists() else ""

    # ------------------------------------------------------------ internals
    def _event(self, what: str, w: _PodWorker, c: _Container) -> None:
        self.events.append((time.time(), what, w.ns, w.name, c.name))

    def _get(self, path: str, optional: bool | None = None) -> dict | None:
        try:
            return self._api.get_json(path)
        except urllib.error.HTTPError as e:
            if e.code == 404 and optional:
                return None
            if e.code == 404:
                raise RuntimeError(f"pod runner: {path} not found") from e
            raise

    def _pods_path(self) -> str:
        if len(self.node_names) == 1:
            return "/api/v1/pods?fieldSelector=spec.nodeName%3D" + next(iter(self.node_names))
        return "/api/v1/pods?"

    def _handle(self, etype: str, pod: dict) -> None:
        meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
        if spec.get("nodeName") not in self.node_names:
            return
        uid = meta.get("uid")
        with self._lock:
            w = self._workers.get(uid)
            gone = etype == "DELETED" or meta.get("deletionTimestamp")
            if gone:
                if w is not None:
                    log.info("pod %s/%s at %s deleted: stopping", w.ns, w.name, w.pod_ip)
                    del self._workers[uid]
                    self._stopping = [o for o in self._stopping if not o.finished.is_set()] + [w]
                    w.stop_event.set()
                return
            if w is not None:
                w.pod["metadata"] = meta  # labels/annotations for later fieldRefs
                return
            if status.get("phase") == "Running" and status.get("podIP"):
                # a pod the runner itself finished: leave it alone
                cs = status.get("containerStatuses") or []
                if any("terminated" in (s.get("state") or {}) for s in cs):
                    return
                # only pods kwok just started (or that we ran before a runner restart)
                w = _PodWorker(self, json.loads(json.dumps(pod)))
                # an older pod may still hold this IP (kwok recycles addresses the moment a pod is deleted): the
                # new pod's worker waits for it to stop (not this watch thread, which must go on handling events)
                for other in [*self._workers.values(), *self._stopping]:
                    if other.pod_ip == w.pod_ip and not other.finished.is_set():
                        other.stop_event.set()
                        w.predecessors.append(other)
                self._workers[uid] = w
                if w.predecessors:
                    names = [f"{o.ns}/{o.name}" for o in w.predecessors]
                    log.info("pod %s/%s at %s waits for %s to stop", w.ns, w.name, w.pod_ip, names)
                w.start()

    def _watch_loop(self) -> None:
        rv = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    lst = self._api.get_json(self._pods_path())
                    rv = lst["metadata"]["resourceVersion"]
                    seen = set()
                    for pod in lst.get("items", []):
                        seen.add(pod["metadata"]["uid"])
                        self._handle("ADDED", pod)
                    with self._lock:
                        stale = [
                            (u, w.pod["spec"].get("nodeName"))
                            for u, w in self._workers.items()
                            if u not in seen
                        ]
                    for u, node in stale:  # deleted while we were not watching
                        self._handle("DELETED", {"metadata": {"uid": u}, "spec": {"nodeName": node}})
                    self._synced.set()
                path = (
                    self._pods_path()
                    + f"&watch=1&allowWatchBookmarks=true&resourceVersion={rv}&timeoutSeconds=5"
                )
                with self._api.request("GET", path, timeout=30) as resp:
                    for line in resp:
                        if self._stop.is_set():
                            break
                        if not line.strip():
                            continue
                        ev = json.loads(line)
                        obj = ev.get("object") or {}
                        if ev.get("type") == "ERROR":
                            rv = None  # 410 Gone etc.: relist
                            break
                        rv = obj.get("metadata", {}).get("resourceVersion", rv)
                        if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                            self._handle(ev["type"], obj)
            except Exception as e:
                if self._stop.is_set():
                    break
                log.warning("pod runner watch error (%s); relisting", e)
                rv = None
                self._stop.wait(1.0)

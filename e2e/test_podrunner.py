"""Pod runner features beyond the smoke test: volumes (hostPath, PVC bound by
the real PV controller, configMap, emptyDir), env + $(VAR) expansion, Job-style
completion, restarts and exec readiness probes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from e2e.cluster import GPU_NODE_LABEL, KwokCluster
from e2e.podrunner import PodRunner

NS = "runner"


def _wait(fn, timeout=60, interval=0.3, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")


def _pod(c: KwokCluster, name: str) -> dict:
    p = c.kubectl("get", "pod", name, "-n", NS, "-o", "json", check=False)
    return json.loads(p.stdout) if p.returncode == 0 else {}


def _spec(name: str, script: str, **extra) -> dict:
    container = {"name": "main", "image": "ignored", "command": ["python3", "-c", script]}
    container.update(extra.pop("container", {}))
    spec = {
        "nodeSelector": {GPU_NODE_LABEL: "true"},
        "terminationGracePeriodSeconds": 1,
        "containers": [container],
    }
    spec.update(extra)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS}, "spec": spec}


def test_volumes_env_and_completion(kwok_cluster: KwokCluster, tmp_path: Path):
    c = kwok_cluster
    host_dir, pvc_dir = tmp_path / "host", tmp_path / "pvc"
    host_dir.mkdir()
    (host_dir / "input.txt").write_text("from the host")
    # paths reach the process as argv elements / env values, which the runner
    # rewrites (not inside the -c source text)
    script = (
        "import os, sys, json\n"
        "e = os.environ\n"
        "out = {'argv': sys.argv[1:4], 'greeting': e['GREETING'], 'pod': e['MY_POD'],\n"
        "       'host': open(e['HOST_FILE']).read(), 'cm': open(sys.argv[4]).read(), 'level': e.get('LEVEL')}\n"
        "open(os.path.join(e['SCRATCH'], 'tmp.txt'), 'w').write('x')\n"
        "json.dump(out, open(sys.argv[5].split('=', 1)[1], 'w'))\n"
    )
    c.apply(
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "cfg", "namespace": NS},
                "data": {"app.conf": "mode=fast", "LEVEL": "debug"},
            },
            # a static PV + claim: the real PV controller binds them before the
            # scheduler will place the pod
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": "results-pv"},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": "manual",
                    "hostPath": {"path": "/srv/results"},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "results", "namespace": NS},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": "manual",
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
            _spec(
                "job",
                script,
                restartPolicy="Never",
                container={
                    "args": [
                        "--name=$(MY_POD)",
                        "$$(NOT_EXPANDED)",
                        "$(UNDEFINED)",
                        "/etc/cfg/app.conf",
                        "--out=/results/out.json",
                    ],
                    "env": [
                        {"name": "MY_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "GREETING", "value": "hello $(MY_POD)"},
                        {"name": "HOST_FILE", "value": "/host/input.txt"},
                        {"name": "SCRATCH", "value": "/scratch"},
                    ],
                    "envFrom": [{"configMapRef": {"name": "cfg"}}],
                    "volumeMounts": [
                        {"name": "host", "mountPath": "/host"},
                        {"name": "cfg", "mountPath": "/etc/cfg"},
                        {"name": "results", "mountPath": "/results"},
                        {"name": "scratch", "mountPath": "/scratch"},
                    ],
                },
                volumes=[
                    {"name": "host", "hostPath": {"path": "/data/input"}},
                    {"name": "cfg", "configMap": {"name": "cfg"}},
                    {"name": "results", "persistentVolumeClaim": {"claimName": "results"}},
                    {"name": "scratch", "emptyDir": {}},
                ],
            ),
        ]
    )
    runner = PodRunner(
        c.kubeconfig,
        c.runner_node_names,
        executables={"python3": sys.executable},
        volumes={"/data/input": host_dir, "results": pvc_dir},
        workdir=tmp_path / "runner",
    )
    with runner:
        try:
            pod = _wait(
                lambda: (
                    _pod(c, "job").get("status", {}).get("phase") in ("Succeeded", "Failed")
                    and _pod(c, "job")
                ),
                what="pod job to finish",
            )
            assert pod["status"]["phase"] == "Succeeded", runner.logs(NS, "job")
            st = pod["status"]["containerStatuses"][0]["state"]["terminated"]
            assert st["exitCode"] == 0 and st["reason"] == "Completed"
            out = json.loads((pvc_dir / "out.json").read_text())
            assert out == {
                "argv": ["--name=job", "$(NOT_EXPANDED)", "$(UNDEFINED)"],
                "greeting": "hello job",
                "pod": "job",
                "host": "from the host",
                "cm": "mode=fast",
                "level": "debug",
            }
        finally:
            c.kubectl("delete", "namespace", NS, "--wait=false", check=False)
            c.kubectl("delete", "pv", "results-pv", "--wait=false", check=False)


def test_restart_and_exec_probe(kwok_cluster: KwokCluster, pod_runner: PodRunner):
    c = kwok_cluster
    ns2 = NS + "-restart"
    # first run: leave a marker in the emptyDir and crash; second run: stay up.
    # Ready only once the exec probe finds the file the second run writes.
    script = (
        "import os, sys, time\n"
        "w = os.environ['WORK']\n"
        "if not os.path.exists(os.path.join(w, 'marker')):\n"
        "    open(os.path.join(w, 'marker'), 'w').close(); sys.exit(3)\n"
        "time.sleep(1.5); open(os.path.join(w, 'ready'), 'w').close()\n"
        "time.sleep(3600)\n"
    )
    pod = _spec(
        "crashy",
        script,
        container={
            "env": [{"name": "WORK", "value": "/work"}],
            "volumeMounts": [{"name": "work", "mountPath": "/work"}],
            "readinessProbe": {"exec": {"command": ["test", "-f", "/work/ready"]}, "periodSeconds": 1},
        },
        volumes=[{"name": "work", "emptyDir": {}}],
    )
    pod["metadata"]["namespace"] = ns2
    c.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns2}}, pod])
    try:

        def ready():
            p = json.loads(c.kubectl("get", "pod", "crashy", "-n", ns2, "-o", "json").stdout)
            conds = {x["type"]: x["status"] for x in p["status"].get("conditions", [])}
            return p if conds.get("Ready") == "True" else None

        p = _wait(ready, timeout=60, what="crashy Ready after one restart")
        cs = p["status"]["containerStatuses"][0]
        assert cs["restartCount"] == 1
        assert cs["lastState"]["terminated"]["exitCode"] == 3
        assert "running" in cs["state"]
        info = pod_runner.get(ns2, "crashy")
        assert info is not None and info.running and info.ready and info.restart_count == 1
    finally:
        c.kubectl("delete", "namespace", ns2, "--wait=false", check=False)
    _wait(lambda: not pod_runner.running(ns2), timeout=30, what="crashy stopped")


SERVER_IMAGE = "ghcr.io/naiad-dev/naiad-server:0.1.0"

IMAGE_SCRIPT = (
    "import json, os, sys\n"
    "e = os.environ\n"
    "try:\n"
    "    open('/opt/written-by-container', 'w')\n"
    "    rootfs = 'writable'\n"
    "except OSError as err:\n"
    "    rootfs = type(err).__name__\n"
    "out = {'argv': sys.argv[1:], 'uid': os.getuid(), 'gid': os.getgid(), 'groups': os.getgroups(),\n"
    "       'greeting': e['GREETING'], 'home': e.get('HOME'), 'host_env': 'NAIAD_TEST_HOST_ONLY' in e,\n"
    "       'cfg': open('/etc/app/mode').read(), 'cwd': os.getcwd(), 'rootfs': rootfs,\n"
    "       'python': sys.executable}\n"
    "json.dump(out, open('/out/result.json', 'w'))\n"
    "sys.exit(3)\n"
)


def test_image_mode_runs_the_container_from_its_image(kwok_cluster: KwokCluster, tmp_path: Path, monkeypatch):
    """Image mode: the pod's image (the built server image) is unpacked and the container runs from it: command
    and args with $(VAR) expansion, the image's env under the pod's (nothing of the host's), volumes at their
    mount paths, securityContext's user over the image's, a read-only root, the exit code in the pod status,
    and an exec probe run inside the running container."""
    from e2e.images import ImageError, ImageStore, missing_tools

    if missing_tools():
        import pytest

        pytest.skip(missing_tools())
    store = ImageStore.from_build()
    try:
        image = store.get(SERVER_IMAGE)
    except ImageError as e:
        import pytest

        pytest.fail(f"{e} (make test runs `make images` first)")
    c = kwok_cluster
    ns = NS + "-image"
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    monkeypatch.setenv("NAIAD_TEST_HOST_ONLY", "1")
    job = _spec(
        "imagejob",
        IMAGE_SCRIPT,
        container={
            "image": SERVER_IMAGE,
            "command": ["python", "-c", IMAGE_SCRIPT],
            "args": ["$(GREETING)", "$$(ESCAPED)", "$(UNDEFINED)"],
            "env": [
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "GREETING", "value": "hello $(POD)"},
            ],
            "securityContext": {"runAsUser": 10002, "runAsGroup": 10003},
            "volumeMounts": [
                {"name": "cfg", "mountPath": "/etc/app", "readOnly": True},
                {"name": "out", "mountPath": "/out"},
            ],
        },
        restartPolicy="Never",
        volumes=[
            {"name": "cfg", "configMap": {"name": "app"}},
            {"name": "out", "hostPath": {"path": "/data/out"}},
        ],
    )
    probed = _spec(
        "probed",
        "",
        container={
            "image": SERVER_IMAGE,
            "command": ["sh", "-c", "sleep 1; touch /tmp/ready; exec sleep 600"],
            "readinessProbe": {"exec": {"command": ["test", "-f", "/tmp/ready"]}, "periodSeconds": 1},
        },
    )
    for pod in (job, probed):
        pod["metadata"]["namespace"] = ns
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app", "namespace": ns}}
    cm["data"] = {"mode": "fast"}
    runner = PodRunner(
        c.kubeconfig,
        c.runner_node_names,
        images=store,
        volumes={"/data/out": out},
        workdir=tmp_path / "runner",
        max_probe_period=1.0,
    )
    with runner:
        c.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}, cm, job, probed])
        try:

            def get(name):
                p = c.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
                return json.loads(p.stdout) if p.returncode == 0 else {}

            try:
                pod = _wait(
                    lambda: (
                        get("imagejob").get("status", {}).get("phase") in ("Succeeded", "Failed")
                        and get("imagejob")
                    ),
                    # the image is unpacked above (store.get); this waits for scheduling, the container and its
                    # exit (seconds; once, under a loaded CI run, not within 240 s: the message says where it was)
                    timeout=240,
                    what="imagejob to finish",
                )
            except AssertionError as exc:
                pods = c.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
                events = c.kubectl("get", "events", "-n", ns, check=False).stdout
                raise AssertionError(
                    f"{exc}\npods:\n{pods}\nevents:\n{events}\nrunner events: {runner.events[-20:]}\n"
                    f"imagejob: {get('imagejob').get('status')}\nlog: {runner.logs(ns, 'imagejob')[-2000:]}"
                ) from None
            assert pod["status"]["phase"] == "Failed", runner.logs(ns, "imagejob")
            status = pod["status"]["containerStatuses"][0]
            assert status["state"]["terminated"]["exitCode"] == 3
            assert status["imageID"] == f"docker-archive://sha256:{image.image_id}"
            result = json.loads((out / "result.json").read_text())
            assert result == {
                "argv": ["hello imagejob", "$(ESCAPED)", "$(UNDEFINED)"],
                "uid": 10002,
                "gid": 10003,
                "groups": [],
                "greeting": "hello imagejob",
                "home": "/home/naiad",  # the image's ENV
                "host_env": False,
                "cfg": "fast",
                "cwd": "/home/naiad",  # the image's WORKDIR
                "rootfs": "OSError",
                "python": "/opt/naiad/bin/python",
            }, runner.logs(ns, "imagejob")
            assert not (image.rootfs / "opt" / "written-by-container").exists()

            def ready():
                conds = {
                    x["type"]: x["status"] for x in get("probed").get("status", {}).get("conditions", [])
                }
                return conds.get("Ready") == "True"

            _wait(ready, timeout=60, what="probed Ready (exec probe inside the container's own /tmp)")
            info = runner.get(ns, "probed")
            assert info is not None and info.image_id == image.image_id and info.ready
        finally:
            c.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        _wait(lambda: not runner.running(ns), timeout=30, what="image pods stopped")


# Binds the pod IP's port 8000 and leaves a daemon behind (a session of its own, SIGTERM ignored) holding 8001: what
# a forked helper or a stray worker of a server does.  It can start only where neither port is listened on (with
# SO_REUSEADDR, as servers bind: earlier tests' connections to a recycled IP's port 8000 linger in TIME_WAIT).
HOLDER_SCRIPT = (
    "import os, signal, socket, sys, time\n"
    "def listen(port):\n"
    "    s = socket.socket()\n"
    "    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "    s.bind((os.environ['POD_IP'], port))\n"
    "    s.listen()\n"
    "    return s\n"
    "main = listen(8000)\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "    daemon = listen(8001)\n"
    "    while True:\n"
    "        time.sleep(1)\n"
    "time.sleep(3600)\n"
)


def test_image_container_stop_leaves_nothing_behind(kwok_cluster: KwokCluster, tmp_path: Path):
    """Image mode: a container killed under the runner (its bwrap SIGKILLed, as test_operator_cluster's self-heal
    scenario does) is restarted only when none of its processes is left, so the restart binds the pod IP's ports
    again; a deleted pod's processes have all exited (a SIGTERM-ignoring daemon included) and its ports are free;
    a new pod that gets the recycled IP starts. Before each container had a PID namespace of its own, the killed
    container's command went on running as uid 10001 and the restart crash-looped on "address already in use"."""
    import os
    import signal
    import socket

    import psutil
    import pytest

    from e2e.images import ImageError, ImageStore, missing_tools

    if missing_tools():
        pytest.skip(missing_tools())
    store = ImageStore.from_build()
    try:
        store.get(SERVER_IMAGE)
    except ImageError as e:
        pytest.fail(f"{e} (make test runs `make images` first)")
    c = kwok_cluster
    ns = NS + "-stop"

    def holder(name: str) -> dict:
        pod = _spec(
            name,
            "",
            container={
                "image": SERVER_IMAGE,
                "command": ["python", "-c", HOLDER_SCRIPT, name],
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                "readinessProbe": {"tcpSocket": {"port": 8001}, "periodSeconds": 1},
            },
        )
        pod["metadata"]["namespace"] = ns
        return pod

    def get(name):
        p = c.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
        return json.loads(p.stdout) if p.returncode == 0 else {}

    def ready(name):
        conds = {x["type"]: x["status"] for x in get(name).get("status", {}).get("conditions", [])}
        return conds.get("Ready") == "True"

    def leftovers(name):  # the container's own processes (the image's user), found by the pod name in argv
        procs = psutil.process_iter(["cmdline", "uids"])
        return [p for p in procs if name in (p.info["cmdline"] or []) and p.info["uids"].real == 10001]

    def port_free(ip, port):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
            return True
        except OSError:
            return False
        finally:
            s.close()

    runner = PodRunner(
        c.kubeconfig, c.runner_node_names, images=store, workdir=tmp_path, max_probe_period=1.0
    )
    with runner:
        c.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}, holder("holder")])
        try:
            _wait(lambda: ready("holder"), timeout=60, what="holder Ready")
            first = runner.get(ns, "holder")
            assert first is not None and first.image_id and first.pid is not None
            assert len(leftovers("holder")) == 2  # the command and its daemon
            os.kill(first.pid, signal.SIGKILL)  # bwrap: the container dies under the runner
            _wait(
                lambda: (i := runner.get(ns, "holder")) is not None and i.restart_count >= 1 and i.ready,
                timeout=60,
                what="holder restarted and Ready again (its ports bound anew)",
            )
            assert runner.get(ns, "holder").restart_count == 1, runner.logs(ns, "holder")
            assert len(leftovers("holder")) == 2, "the killed container's processes are still running"
            ip = get("holder")["status"]["podIP"]
            c.kubectl("delete", "pod", "holder", "-n", ns, "--wait=false")
            c.apply([holder("holder2")])  # likely given the recycled IP at once
            _wait(lambda: runner.get(ns, "holder") is None, timeout=30, what="holder's worker gone")
            _wait(lambda: not leftovers("holder"), timeout=30, what="holder's processes gone")
            if get("holder2").get("status", {}).get("podIP") != ip:
                _wait(
                    lambda: port_free(ip, 8000) and port_free(ip, 8001),
                    timeout=10,
                    what="holder's ports free",
                )
            _wait(lambda: ready("holder2"), timeout=60, what="holder2 Ready")
            assert runner.get(ns, "holder2").restart_count == 0, runner.logs(ns, "holder2")
        finally:
            c.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        _wait(lambda: not runner.running(ns), timeout=30, what="holder pods stopped")
    assert not leftovers("holder2"), "a process of a stopped pod is left after the runner stopped"

"""e2e/poddns.py: the hosts lines a headless Service's pods get, and the file rewritten in place as pods come and
go (a process that bind-mounted it sees the new lines)."""

from __future__ import annotations

import json

from e2e.poddns import PodHosts, host_entries


def pod(name, ip, subdomain="grp", hostname=None, deleting=False):
    meta = {"name": name, "namespace": "ns", **({"deletionTimestamp": "x"} if deleting else {})}
    spec = {"subdomain": subdomain, **({"hostname": hostname} if hostname else {})}
    return {"metadata": meta, "spec": spec, "status": {"podIP": ip}}


def test_host_entries_name_pods_under_their_subdomain():
    pods = [
        pod("grp-0", "198.18.0.1"),
        pod("grp-0-1", "198.18.0.2", hostname="grp-0-1"),
        pod("lonely", "198.18.0.3", subdomain=None),  # no headless Service: no name
        pod("starting", None),  # no IP yet
        pod("going", "198.18.0.4", deleting=True),
    ]
    assert host_entries(pods) == [
        "198.18.0.1 grp-0.grp.ns.svc.cluster.local grp-0.grp.ns.svc grp-0.grp.ns",
        "198.18.0.2 grp-0-1.grp.ns.svc.cluster.local grp-0-1.grp.ns.svc grp-0-1.grp.ns",
    ]


def test_hosts_file_is_rewritten_in_place(tmp_path):
    listing = {"items": [pod("grp-0", "198.18.0.1")]}
    hosts = PodHosts(lambda: json.dumps(listing), tmp_path / "hosts")
    hosts.refresh()
    inode = (tmp_path / "hosts").stat().st_ino
    assert "198.18.0.1 grp-0.grp.ns" in (tmp_path / "hosts").read_text()
    listing["items"] = [pod("grp-0-1", "198.18.0.9")]
    hosts.refresh()
    text = (tmp_path / "hosts").read_text()
    assert (
        "grp-0.grp" not in text
        and "198.18.0.9 grp-0-1.grp.ns" in text
        and text.startswith("127.0.0.1 localhost")
    )
    assert (tmp_path / "hosts").stat().st_ino == inode
    script = hosts.launcher("/bin/true", tmp_path / "run")
    assert "unshare --mount" in script.read_text() and script.stat().st_mode & 0o111


def endpoint_slice(service, addresses, headless=True, ready=True, terminating=False):
    labels = {
        "kubernetes.io/service-name": service,
        **({"service.kubernetes.io/headless": ""} if headless else {}),
    }
    return {
        "metadata": {"name": f"{service}-abcde", "namespace": "ns", "labels": labels},
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready, "terminating": terminating}}
            for ip in addresses
        ],
    }


def test_headless_services_are_named_at_their_endpoints_but_the_terminating_ones(tmp_path):
    slices = {
        "items": [
            endpoint_slice("pool-headless", ["198.18.0.2"]),
            endpoint_slice("pool-headless", ["198.18.0.1"], ready=False),  # starting: named already
            endpoint_slice("pool-headless", ["198.18.0.3"], ready=False, terminating=True),  # going: not
            endpoint_slice("pool", ["198.18.0.1"], headless=False),  # a ClusterIP Service: its IP, not here
        ]
    }
    hosts = PodHosts(
        lambda: json.dumps({"items": []}),
        tmp_path / "hosts",
        endpoint_slices=lambda: json.dumps(slices),
        static=["127.0.0.1 scaler.keda"],
    )
    hosts.refresh()
    lines = (tmp_path / "hosts").read_text().splitlines()
    assert lines[2:] == [
        "127.0.0.1 scaler.keda",
        "198.18.0.1 pool-headless.ns.svc.cluster.local pool-headless.ns.svc pool-headless.ns",
        "198.18.0.2 pool-headless.ns.svc.cluster.local pool-headless.ns.svc pool-headless.ns",
    ]

"""Configuration files of the real node: containerd, the CNI network, the kubelet and kube-proxy."""

from __future__ import annotations

import json
from pathlib import Path

#: the CNI bridge in the pod network's namespace (Linux limits link names to 15 characters)
BRIDGE = "naiad-br0"
#: where Debian's containernetworking-plugins puts bridge, host-local, loopback, portmap
CNI_BIN_DIR = "/usr/lib/cni"
#: containerd's state and sockets, on a tmpfs private to the node's mount namespace
CONTAINERD_STATE = "/run/containerd"
CONTAINERD_SOCK = f"{CONTAINERD_STATE}/containerd.sock"
#: the kubelet's root dir (pod volumes, device-plugin sockets), also a tmpfs private to the node's mount namespace
KUBELET_ROOT = "/var/lib/kubelet"


def containerd_toml(root: Path, cni_conf_dir: Path, sandbox_image: str) -> str:
    """containerd 1.6 config (version 2): CRI with runc (cgroupfs), overlayfs, the CNI dirs, an offline sandbox image."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root}"
state = "{CONTAINERD_STATE}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]

[grpc]
  address = "{CONTAINERD_SOCK}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"

[{cri}]
  sandbox_image = "{sandbox_image}"
  disable_apparmor = true
  # root here may lack CAP_SYS_RESOURCE: never ask runc for an oom_score_adj below containerd's own
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  BinaryName = "/usr/sbin/runc"

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{cni_conf_dir}"
  max_conf_num = 1
"""


def cni_conflist(pod_cidr: str, ipam_dir: Path) -> str:
    """A bridge network with host-local IPAM over the node's pod CIDR, and portmap for hostPorts."""
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "naiad-e2e",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": True,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": pod_cidr}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(ipam_dir),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        },
        indent=2,
    )


def kubelet_config(*, node_ip: str, cgroup_root: str, cgroup_v1: bool) -> dict:
    """KubeletConfiguration for the e2e node.

    cgroupfs driver (no systemd on the machines this runs on); ``failCgroupV1: false`` on a v1/hybrid host,
    because kubelet 1.36 refuses cgroup v1 unless told otherwise. The API server reaches the kubelet (logs, exec)
    with no client certificate, so the kubelet API allows anonymous requests -- it listens only on the node IP
    inside the test's private network namespace. Eviction thresholds are near zero so a busy shared CI disk or
    memory does not evict the test pods.
    """
    conf: dict = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "cgroupsPerQOS": True,
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCK}",
        "address": node_ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 0,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "failSwapOn": False,
        "resolvConf": "",
        "serializeImagePulls": False,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "nodeStatusUpdateFrequency": "2s",
        "syncFrequency": "5s",
        "fileCheckFrequency": "5s",
        "podPidsLimit": 4096,
        "maxPods": 30,
        "protectKernelDefaults": False,
    }
    if cgroup_v1:
        conf["failCgroupV1"] = False
    return conf


def kube_proxy_config(*, kubeconfig: str, node_name: str, node_ip: str, pod_cidr: str) -> dict:
    """KubeProxyConfiguration: iptables mode; masqueradeAll so a pod reaching its own Service answers through the
    node (no br_netfilter needed); conntrack limits left to the kernel (the namespace is not the host's)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": kubeconfig},
        "hostnameOverride": node_name,
        "bindAddress": node_ip,
        "clusterCIDR": pod_cidr,
        "mode": "iptables",
        "iptables": {"masqueradeAll": True, "syncPeriod": "5s", "minSyncPeriod": "0s"},
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "healthzBindAddress": "",
        "metricsBindAddress": "127.0.0.1:10249",
    }

"""A real Kubernetes node (containerd, runc, CNI bridge, kubelet, kube-proxy) beside kwok's fake nodes (see e2e/README.md)."""

from .node import NodeError, RealNode

__all__ = ["NodeError", "RealNode"]

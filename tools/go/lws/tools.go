//go:build tools

// Package tools pins the LeaderWorkerSet controller (sigs.k8s.io/lws's cmd, the manager that runs the
// LeaderWorkerSet and Pod reconcilers and its admission webhooks), which runs a group of pods (one leader, its
// workers) per replica of a model too large for one node.
package tools

import _ "sigs.k8s.io/lws/cmd"

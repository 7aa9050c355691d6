//go:build tools

// Package tools pins the Gateway API Inference Extension's endpoint picker (EPP), the ext-proc server that picks
// a model server pod per request from the pods' queue, KV-cache and prefix-cache state.
package tools

import _ "sigs.k8s.io/gateway-api-inference-extension/cmd/epp/runner"

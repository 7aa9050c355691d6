//go:build tools

// Package tools pins h2spec, the HTTP/2 conformance checker run against Naiad's gRPC port (tests/test_h2spec.py).
package tools

import _ "github.com/summerwind/h2spec/cmd/h2spec"

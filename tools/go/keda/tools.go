//go:build tools

// Package tools pins KEDA (github.com/kedacore/keda/v2: the operator that scales a workload to and from zero on its
// triggers) and its HTTP add-on (github.com/kedacore/http-add-on: the interceptor, a proxy that holds requests
// while a workload at zero replicas starts; the external scaler that tells KEDA how many requests wait; the
// operator that turns an HTTPScaledObject into KEDA's ScaledObject). A pool at zero pods wakes through them.
package tools

import (
	_ "github.com/kedacore/http-add-on/interceptor"
	_ "github.com/kedacore/http-add-on/operator"
	_ "github.com/kedacore/http-add-on/scaler"
	_ "github.com/kedacore/keda/v2/cmd/operator"
)

//go:build tools

// Package tools pins MinIO, the S3-compatible object store the storage tests run against.
package tools

import _ "github.com/minio/minio"

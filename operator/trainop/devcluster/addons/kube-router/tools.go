//go:build tools

// Blank import keeps 'go mod tidy' from dropping kube-router, whose network policy controller we build.
package tools

import _ "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"

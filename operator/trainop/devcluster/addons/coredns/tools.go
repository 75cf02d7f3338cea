//go:build tools

// Blank import keeps 'go mod tidy' from dropping CoreDNS.
package tools

import _ "github.com/coredns/coredns"

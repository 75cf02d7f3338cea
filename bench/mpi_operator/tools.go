//go:build tools

package tools

import _ "github.com/kubeflow/mpi-operator/cmd/mpi-operator"

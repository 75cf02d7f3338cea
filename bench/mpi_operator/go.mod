// Wrapper module that builds Kubeflow's MPI Operator v0.6.0 for bench/control_plane.py (the
// proxy refuses `go install ...@v0.6.0`; see /work/shared/TOOLCHAIN.md).
module trainop.local/bench/mpioperator

go 1.23

require github.com/kubeflow/mpi-operator v0.6.0

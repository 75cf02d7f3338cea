"""The local dev cluster: real Kubernetes control-plane binaries plus KWOK nodes, no containers."""

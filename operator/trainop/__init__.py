"""trainop: a Kubernetes operator for distributed deep-learning training."""

GROUP = "trainop.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

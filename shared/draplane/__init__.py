"""draplane: a Dynamic Resource Allocation control plane for Kubernetes."""

__version__ = "0.1.0"

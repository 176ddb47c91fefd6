"""Typed models of the Kubernetes objects draplane reads and writes, decoded once at the edge."""

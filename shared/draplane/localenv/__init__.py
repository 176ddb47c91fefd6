"""The local control plane: real etcd, kube-apiserver and NATS built from Go modules."""

"""What Kubernetes' component-helpers are to its components: the rules several parts of draplane
read a pod or a node by, each written once. A node selector term matches a node
(`node_affinity`), a toleration covers a taint (`taints`), and a pod asks its node for so much CPU,
memory and every other resource (`resource`).

Pure: no I/O. The scheduling framework's plugins, the device allocator (device taints, a
claim's node selector) and the gang search all read them here."""

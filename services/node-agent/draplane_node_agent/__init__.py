"""The draplane node agent: discovers a node's devices and streams them to NATS."""

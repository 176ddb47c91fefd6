"""The NATS message contract between draplane's services: subjects, streams, buckets and messages.

Every message is a versioned msgspec Struct, encoded once at the edge (msgpack) and decoded once at
the edge. One module per data flow; `inventory` is node-agent -> inventory -> allocators.
"""

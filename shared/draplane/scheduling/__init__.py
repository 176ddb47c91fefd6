"""The pure pod-level core of scheduling: the messages between binder and allocator shards, the
reservation protocol, the claim lifecycle, what a shard knows and how it places a pod or a gang
(placing, gang_placing, preemption and kube-scheduler's pod plugins), and the words used to
explain an unschedulable pod.

No I/O and no asyncio, so the services, the CLI and the tests share it. The NATS edges that carry
its decisions are in draplane.jetstream; simulated nodes and workloads in draplane.simulation.
"""

"""Scheduling pods with claims through NATS: the messages between binder and allocator shards,
the reservation protocol, the claim lifecycle, and the words used to explain an unschedulable pod.

Everything here is pure (no I/O, no asyncio) so the services, the CLI and the tests share it.
"""

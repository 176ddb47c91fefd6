"""Scheduling pods with claims through NATS: the messages between binder and allocator shards,
the reservation protocol, the claim lifecycle, and the words used to explain an unschedulable pod.

messages, reservations, unschedulable, placing and scenario are pure (no I/O, no asyncio) so the services, the CLI
and the tests share them; streams and reservation_store are the thin NATS edges both services use.
"""

"""The NATS JetStream edges the services share: start-up streams and buckets asked again while
JetStream does not answer yet (setup), the streams and buckets of scheduling and their watches
(streams), and the reservation bucket's reads and compare-and-set writes (reservation_store).

Every decision they carry out is in the pure core, draplane.scheduling; these only read, write
and retry.
"""

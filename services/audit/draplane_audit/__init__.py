"""draplane-audit: the audit log and the cluster metrics, from NATS."""

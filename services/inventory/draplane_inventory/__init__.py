"""The draplane inventory service."""

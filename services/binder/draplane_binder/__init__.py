"""The draplane binder service."""

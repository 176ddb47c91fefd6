"""The draplane allocator service."""

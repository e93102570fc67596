"""kvops: operations tooling for paged KV caches."""

__version__ = "0.1.0"

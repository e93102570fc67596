"""Modules the tests share: stand-in servers and clients, synthetic snapshots, waiting with a deadline."""

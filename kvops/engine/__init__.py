"""The paged-KV inference engine (imported as kvops.engine)."""

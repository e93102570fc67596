"""The supervisor (`kvops run`): managed engines, the snapshot history, fixes with verification and
rollback, the JSON API and the Prometheus exporter, and the configuration that ties them together."""

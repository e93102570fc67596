"""An engine's KV cache events, block by block: the wire format (wire), the ZMQ subscriber with its gap
detection and replay (subscriber), and the resident-block index the events build (index), whose view is
kvops.schema.kv_events.KvEventStats."""

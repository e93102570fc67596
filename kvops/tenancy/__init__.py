"""Tenants, shared by the engine, the tenant gateway and the supervisor: the API keys that name them
(`api_keys`), the rule for their names (`names`), and their capped `tenant` label in Prometheus series
(`labels`). Below every package that serves or watches them; it imports only kvops.schema."""

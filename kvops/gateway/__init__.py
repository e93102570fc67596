"""`kvops gateway`: a tenant-aware, OpenAI-compatible reverse proxy in front of vLLM (or a kvops engine).

API keys decide each request's tenant; the tenant's policy decides its cache salt (shared, isolated or a named
group), prompt normalization and limits; every request is accounted per tenant on the gateway's own `/metrics` and
`/stats/tenants`. See docs/gateway.md. Torch-free, and nothing of the engine: its API keys and tenant names
are kvops.tenancy's, its prompt normalization kvops.prompt_normalization, which the engine uses too.
"""

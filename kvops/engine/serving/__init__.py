"""The engine's HTTP service (`kvops engine serve`): the app (`app.build_app`) and its routes, the request and
response bodies, who a request is from (`auth`), the step-loop thread behind the routes (`async_engine`), and
what /metrics and /stats send (`metrics`, `snapshot_cache`). The engine itself (kvops.engine) knows nothing of
HTTP; docs/server.md describes the API."""

"""``longctx serve``: an OpenAI-compatible HTTP server over one engine.

Modules: ``config`` (ServerConfig: the serve flags), ``protocol`` (request bodies and response
JSON), ``errors`` (OpenAI-shaped errors), ``gate`` (API key, body size), ``engine_loop`` (the
engine thread), ``metrics`` (Prometheus), ``app`` (routes), ``launch`` (socket, uvicorn,
signals). Imports FastAPI and uvicorn, so ``longctx.entrypoints.cli`` imports this package only to serve.
"""

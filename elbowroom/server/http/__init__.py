"""HTTP hardening and the middlewares, below every route: the body gate and its limits,
Host/Origin/CORS, API keys, slow connections, multipart uploads, the guard's admission gate,
/metrics and its middleware, which paths speak Ollama (docs/security.md)."""

"""What every protocol's routes share to run a request: holding a runner for the request's
lifetime, one call on a model, relaying the engine's own stream
(docs/architecture-paths.md)."""

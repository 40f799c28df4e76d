"""OpenAI's API: /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings,
/v1/audio/*; request schemas and response shapes (docs/api.md)."""

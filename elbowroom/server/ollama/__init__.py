"""Ollama's API under /api, translated onto the OpenAI path; /api/pull and /api/delete
(docs/api.md#ollama-api, docs/pull.md)."""

"""Which requests speak Ollama's API, told by their path before any route runs, and
Ollama's error body: what the middlewares (auth, the body gate, admission, metrics) and
the OpenAI routes need of Ollama, apart from its routes and shapes (server/ollama/shapes.py).
"""

from __future__ import annotations

from typing import Any

from elbowroom.errors import ElbowroomError

# Ollama's routes: errors on these are answered in Ollama's shape, even by the middlewares.
_OLLAMA_NAMES = ("tags", "ps", "show", "version", "chat", "generate", "embed", "embeddings")
OLLAMA_PATHS = frozenset(
    "/api/" + name for name in (*_OLLAMA_NAMES, "pull", "push", "create", "copy", "delete")
)
# The Ollama routes that start work on a model (the memory guard refuses them while hard).
OLLAMA_WORK_PATHS = frozenset({"/api/chat", "/api/generate", "/api/embed", "/api/embeddings"})


def is_ollama_path(path: str) -> bool:
    return path in OLLAMA_PATHS or path.startswith("/api/blobs/")


def strip_tag(name: str) -> str:
    """Ollama names carry a tag ("model:latest"); elbowroom's ids do not."""
    return name[: -len(":latest")] if name.endswith(":latest") else name


def error_body(err: ElbowroomError) -> dict[str, Any]:
    """Ollama's error shape, ``{"error": "message"}``; the numbers of a 507 or a 503 (needed,
    available, retry_after, ...) ride along as extra fields."""
    return {"error": err.message, **err.details}

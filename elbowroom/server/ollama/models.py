"""PURE: how elbowroom's models look through Ollama's API: /api/tags entries, /api/show,
/api/ps entries (Ollama's fields from elbowroom's measurements, elbowroom's row alongside).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from elbowroom.models.catalog import LATEST
from elbowroom.models.spec import ModelKind, ModelSpec
from elbowroom.server.ollama.shapes import iso_at

# Ollama's "keep forever" is a session of the longest Go duration: an expiry ~292 years out.
FOREVER_SECONDS = (2**63 - 1) / 1e9


def digest(spec: ModelSpec) -> str:
    """A stable id of the weights' version: sha256 of path, size and mtime (hashing the
    weights themselves would read gigabytes per listing)."""
    try:
        identity = spec.identity
    except OSError:
        identity = str(spec.path)
    return hashlib.sha256(identity.encode()).hexdigest()


def modified_at(spec: ModelSpec) -> str:
    try:
        return iso_at(spec.path.stat().st_mtime)
    except OSError:
        return iso_at(0)


def human_params(n: int | None) -> str:
    """135_000_000 -> "135M", 1_240_000_000 -> "1.2B" (Ollama's parameter_size style)."""
    if not n:
        return ""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return str(n)


def details(spec: ModelSpec) -> dict[str, Any]:
    g = spec.gguf
    family = g.architecture if g is not None else spec.engine
    return {
        "parent_model": "",
        "format": "gguf" if g is not None else spec.engine,
        "family": family,
        "families": [family],
        "parameter_size": human_params(g.n_params if g is not None else None),
        "quantization_level": (g.file_type or "") if g is not None else "",
    }


def capabilities(spec: ModelSpec) -> list[str]:
    if spec.kind is ModelKind.EMBEDDING:
        return ["embedding"]
    if spec.kind is ModelKind.LLM:
        # Tools work on every LLM: natively through a template that knows them, else
        # emulated with a JSON schema (docs/api.md).
        return ["completion", "tools", *(["vision"] if spec.vision else [])]
    return []


def ollama_name(spec: ModelSpec) -> str:
    """The model's name as Ollama lists it, with its tag (every route takes either)."""
    return spec.id + LATEST


def tag(spec: ModelSpec) -> dict[str, Any]:
    """One entry of /api/tags."""
    return {
        "name": ollama_name(spec),
        "model": ollama_name(spec),
        "modified_at": modified_at(spec),
        "size": spec.size_bytes,
        "digest": digest(spec),
        "details": details(spec),
    }


def model_info(spec: ModelSpec) -> dict[str, Any]:
    g = spec.gguf
    if g is None:
        return {"general.architecture": spec.engine, "general.basename": spec.id}
    arch = g.architecture
    info: dict[str, Any] = {
        "general.architecture": arch,
        "general.basename": g.name,
        "general.file_type": g.file_type,
        "general.parameter_count": g.n_params,
        f"{arch}.context_length": g.trained_ctx,
        f"{arch}.embedding_length": g.n_embd,
        f"{arch}.block_count": g.n_layers,
        f"{arch}.attention.head_count": g.n_heads,
        f"{arch}.attention.head_count_kv": g.n_kv_heads,
        f"{arch}.attention.key_length": g.head_dim_k,
        f"{arch}.attention.value_length": g.head_dim_v,
    }
    if g.n_vocab:
        info["tokenizer.ggml.vocab_size"] = g.n_vocab
    return {k: v for k, v in info.items() if v is not None}


def show(spec: ModelSpec) -> dict[str, Any]:
    """/api/show. elbowroom has no Modelfiles: the modelfile says where the model came from."""
    return {
        "modelfile": (
            f"# elbowroom serves {spec.path} ({spec.source}); it has no Modelfiles.\n"
            f"FROM {spec.path}\n"
        ),
        "parameters": "",
        "template": "",
        "license": "",
        "details": details(spec),
        "model_info": model_info(spec),
        "capabilities": capabilities(spec),
        "modified_at": modified_at(spec),
        "elbowroom": {
            "kind": str(spec.kind),
            "engine": spec.engine,
            "holding": str(spec.holding),
            "source": spec.source,
            "path": str(spec.path),
            "size": spec.size_bytes,
            "description": spec.description,
        },
    }


def ps_entry(spec: ModelSpec, row: Mapping[str, Any], now_wall: float) -> dict[str, Any]:
    """One /api/ps model: Ollama's fields from elbowroom's measurements; elbowroom's own row
    (state, pid, anonymous/file-backed bytes, ...) rides along, except that ``expires_at``
    follows Ollama (a far-future time for a model that never expires; elbowroom's null is
    ``keep_alive_expires``)."""
    gpu = int(row.get("gpu") or 0)
    expires = row.get("expires_at")
    forever = iso_at(min(now_wall + FOREVER_SECONDS, 253402300799.0))  # year 9999 at most
    return {
        **row,
        "name": ollama_name(spec),
        "model": ollama_name(spec),
        "size": int(row.get("bytes") or 0) + gpu,
        "size_vram": gpu,
        "digest": digest(spec),
        "details": details(spec),
        "expires_at": _z(expires) if expires else forever,
        "keep_alive_expires": expires,
        "context_length": row.get("n_ctx") or 0,
    }


def _z(iso: str) -> str:
    return iso.replace("+00:00", "Z")

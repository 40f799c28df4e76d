"""What the audio and embeddings routes share: pick the model, run one request on it.

OpenAI model names (``whisper-1``, ``tts-1``, ``text-embedding-3-small``, ...) are aliases:
each maps to candidate model ids, the first one in the catalog wins. A model in the catalog
under the alias's own name takes precedence over the alias.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from elbowroom.engines.requests import Payload
from elbowroom.errors import BadRequest, ElbowroomError, ModelNotFound
from elbowroom.models.spec import ModelKind, ModelSpec
from elbowroom.server.deps import CatalogService, SchedulerService

TRANSCRIPTION_ALIASES: Mapping[str, tuple[str, ...]] = {
    "whisper-1": ("whisper-tiny.en", "sphinx-en-us"),
    "gpt-4o-mini-transcribe": ("whisper-tiny.en", "sphinx-en-us"),
    "gpt-4o-transcribe": ("whisper-tiny.en", "sphinx-en-us"),
}
SPEECH_ALIASES: Mapping[str, tuple[str, ...]] = {
    "tts-1": ("piper-en-us-joe",),
    "tts-1-hd": ("piper-en-us-joe",),
    "gpt-4o-mini-tts": ("piper-en-us-joe",),
}
EMBEDDING_ALIASES: Mapping[str, tuple[str, ...]] = {
    "text-embedding-3-small": ("minilm-l6-v2",),
    "text-embedding-ada-002": ("minilm-l6-v2",),
}


ALIASES: tuple[Mapping[str, tuple[str, ...]], ...] = (
    TRANSCRIPTION_ALIASES,
    SPEECH_ALIASES,
    EMBEDDING_ALIASES,
)


def alias_target(catalog: CatalogService, name: str) -> ModelSpec | None:
    """The model an OpenAI alias (``whisper-1``, ...) stands for here; None: not an alias,
    or none of its targets is in the catalog."""
    for aliases in ALIASES:
        if name in aliases:
            try:
                return _alias(catalog, name, aliases)
            except ModelNotFound:
                return None
    return None


def resolve_model(
    catalog: CatalogService,
    requested: str | None,
    kind: ModelKind,
    aliases: Mapping[str, tuple[str, ...]],
    endpoint: str,
) -> ModelSpec:
    """The ModelSpec to serve ``requested`` with; None means the first alias's target.

    Unknown -> ModelNotFound (404); a model of another kind -> BadRequest naming the kind.
    """
    if requested is None:
        requested = next(iter(aliases))
    try:
        spec: ModelSpec = catalog.get(requested)
    except ModelNotFound:
        spec = _alias(catalog, requested, aliases)
    if spec.kind != kind:
        raise BadRequest(
            f"The model {spec.id!r} is of kind {spec.kind!s} ({spec.engine}); {endpoint} needs "
            f"a model of kind {kind!s}. GET /v1/models lists each model's kind.",
            param="model",
            code="model_not_supported",
        )
    return spec


def _alias(
    catalog: CatalogService, requested: str, aliases: Mapping[str, tuple[str, ...]]
) -> ModelSpec:
    for target in aliases.get(requested, ()):
        try:
            found: ModelSpec = catalog.get(target)
        except ModelNotFound:
            continue
        return found
    raise ModelNotFound(requested)


async def run_once(
    scheduler: SchedulerService,
    model_id: str,
    keep_alive: float | None,
    op: str,
    payload: Payload,
) -> dict[str, Any]:
    """Run one non-streaming request and return the runner's final result."""
    async with scheduler.use(model_id, keep_alive=keep_alive) as runner:
        return await answer(runner, op, payload)


class Requester(Protocol):
    """What ``answer`` needs of a runner (runtime.protocol.Runner has it)."""

    def request(self, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]: ...


async def answer(runner: Requester, op: str, payload: Payload) -> dict[str, Any]:
    """``op`` on a held runner, to its final result (deltas are passed over)."""
    events = runner.request(op, payload)
    try:
        async for item in events:
            if item.get("type") == "done":
                return dict(item)
    finally:
        # Closing early (client gone, error) tells the worker to cancel the work.
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()
    raise ElbowroomError(f"the runner ended {op!r} without a result")

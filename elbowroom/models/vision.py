"""Vision: multimodal projectors (``mmproj`` GGUF), what they cost, and the vision gate.

A vision model is an LLM GGUF plus its projector: a ViT encoder that turns an image into
embeddings in the text model's width (llama.cpp's mtmd/clip). Pairing (docs/models.md):

- side by side: ``mmproj*.gguf`` files in the model's folder. One such file pairs with
  every model of the folder; with several, a model takes the one whose name, less the
  ``mmproj`` prefix, shares the longest start with the model's own name (at least
  ``MIN_SHARED`` characters, models/projector_names.py: ``mmproj-gemma-3-4b-f16.gguf`` pairs with
  ``gemma-3-4b-it-Q4_K_M.gguf``, not with ``qwen2.5-vl-3b.gguf``);
- explicitly: ``model_projectors = ["ID=PATH"]`` (config), which wins over a sibling.

What a projector costs, on top of the text model (``extra_footprint``):

- its weights: clip.cpp reads the tensors into anonymous memory (no mmap);
- the encoder's working memory, which appears when an image is encoded: the image as
  floats, the patch matrix, activations over every patch, the image tokens' embeddings
  (attention runs flash-style on the CPU: no patches² score matrix), plus a fixed part
  (clip context, scheduler), calibrated with benchmarks/vision_footprint.py; clip.cpp's
  warm-up encodes one full-size image at load, so part of it is there before any request;
- the image tokens' KV: llama.cpp allocates the whole context's KV at load, so image
  tokens take context, not extra bytes; a request whose images cannot fit the context is
  refused before decoding (server/openai/images.py).

The gate (``gate``): a vision model whose footprint exceeds ``vision_gate`` of its pool's
limit (default 0.70, the seed's figure: vision models died in Metal above ~73 % while text
models of the same size only swapped) is refused with 507; a text model above it is only
logged.
"""

from __future__ import annotations

import enum
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from elbowroom.errors import InsufficientMemory
from elbowroom.models.spec import ModelSpec, Projector
from elbowroom.units import format_size

if TYPE_CHECKING:
    from elbowroom.models.gguf_meta import Header

log = logging.getLogger(__name__)

MiB = 1 << 20
F32 = 4
# Encoder working memory: activations kept per patch and encoder width (residual, norm,
# q/k/v, attention output, MLP in/out), per patch and MLP width (up + activation), and a
# fixed part (clip context, backend scheduler, the decoded image). Calibrated with the test
# projectors at 448 and 896 px and 2 or 8 layers (benchmarks/vision_footprint.py).
ACT_PER_EMBD = 8
ACT_PER_FF = 2
ENCODER_FIXED = int(7.3 * MiB)
# At load, clip.cpp's warm-up encodes one image of the full size: the projector's weights,
# a fixed part, and that image's input and patch matrix are touched before any request.
LOAD_FIXED = int(3.5 * MiB)


@dataclass(frozen=True, slots=True)
class VisionCost:
    weights: int  # projector tensors (anonymous)
    at_load: int  # anonymous bytes the projector adds right after load (weights included)
    working: int  # more anonymous bytes while an image is encoded
    image_tokens: int  # per image

    @property
    def total(self) -> int:
        return self.at_load + self.working


def read_projector(path: Path) -> Projector:
    """The projector's shape, from its GGUF header; InvalidModel when it is not a vision
    projector llama.cpp could load."""
    # Imported here: the GGUF reader pulls in the gguf package (numpy, yaml: ~13 MiB and
    # ~0.1 s), and the LLM runner imports this module only for ``extra_footprint``.
    from elbowroom.models.gguf_meta import InvalidModel, looks_like_gguf, read_header

    path = Path(path)
    if not looks_like_gguf(path):
        raise InvalidModel(f"{path} is not a GGUF file (no GGUF magic number)")
    try:
        header = read_header(path)
    except (ValueError, OSError, OverflowError, struct.error) as exc:
        raise InvalidModel(f"{path} is not a readable GGUF file: {exc}") from exc
    return projector_from_header(header, path)


def projector_from_header(header: Header, path: Path) -> Projector:
    """The projector's shape from its parsed header (read from disk, or over HTTP by
    `elbowroom pull`); InvalidModel when it is not a vision projector."""
    from elbowroom.models.gguf_meta import InvalidModel

    f = header.fields
    if f.get("general.architecture") != "clip":
        raise InvalidModel(f"{path} is not a projector (general.architecture is not 'clip')")
    if f.get("clip.has_vision_encoder") is not True:
        raise InvalidModel(f"{path} has no vision encoder (an audio-only projector?)")
    kind = f.get("clip.projector_type") or f.get("clip.vision.projector_type")
    if not isinstance(kind, str) or not kind:
        raise InvalidModel(f"{path} names no clip.projector_type")

    def num(key: str, default: int | None = None, lo: int = 1, hi: int = 1 << 20) -> int:
        value = f.get(f"clip.vision.{key}", default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise InvalidModel(f"{path}: clip.vision.{key} = {value!r} is missing or implausible")
        return value

    image_size, patch = num("image_size"), num("patch_size", hi=4096)
    merge = num("projector.scale_factor", 1, hi=64)
    if kind == "gemma3" and "clip.vision.projector.scale_factor" not in f:
        merge = 4  # clip.cpp's default for every Gemma 3 size
    side = max(1, image_size // patch // merge)
    return Projector(
        path=path,
        projector_type=kind,
        image_size=image_size,
        patch_size=patch,
        n_embd=num("embedding_length"),
        n_ff=num("feed_forward_length", 0, lo=0, hi=1 << 24),
        n_layer=num("block_count", hi=4096),
        n_head=num("attention.head_count", hi=1 << 16),
        merge=merge,
        weight_bytes=sum(nbytes for _name, nbytes in header.tensors),
        image_tokens=side * side,
    )


def extra_footprint(proj: Projector, text_embd: int) -> VisionCost:
    """PURE: what the projector adds to its LLM's footprint (module docstring)."""
    patches = proj.n_patches
    image = proj.image_size**2 * 3 * F32  # one image as floats (preprocessed, graph input)
    im2col = patches * 3 * proj.patch_size**2 * F32
    acts = patches * (ACT_PER_EMBD * proj.n_embd + ACT_PER_FF * proj.n_ff) * F32
    out = 2 * proj.image_tokens * text_embd * F32  # the embeddings, and the batch's copy
    at_load = proj.weight_bytes + LOAD_FIXED + image + im2col  # the warm-up's share
    total = proj.weight_bytes + ENCODER_FIXED + 2 * image + im2col + acts + out
    return VisionCost(
        weights=proj.weight_bytes,
        at_load=at_load,
        working=max(0, total - at_load),
        image_tokens=proj.image_tokens,
    )


def capabilities(spec: ModelSpec) -> list[str]:
    """What a model takes and gives, for /v1/models and ``elbowroom ls``."""
    caps = {
        "llm": ["completion", "chat"],
        "asr": ["transcription"],
        "tts": ["speech"],
        "embedding": ["embedding"],
    }.get(str(spec.kind), [])
    return [*caps, "vision"] if spec.vision else caps


# --- the vision gate --------------------------------------------------------------------


class Verdict(enum.StrEnum):
    OK = "ok"
    WARN = "warn"  # a text model above the fraction: loaded, logged
    REFUSE = "refuse"  # a vision model above the fraction: 507


@dataclass(frozen=True, slots=True)
class GateCheck:
    verdict: Verdict
    model: str
    footprint: int
    pool_limit: int
    fraction: float
    pool: str = "memory"

    @property
    def share(self) -> float:
        return self.footprint / self.pool_limit if self.pool_limit > 0 else float("inf")

    def message(self) -> str:
        kind = "vision" if self.verdict is Verdict.REFUSE else "text"
        head = (
            f"{self.model} needs {format_size(self.footprint)}, {self.share:.0%} of the "
            f"{format_size(self.pool_limit)} {self.pool} limit; the vision gate is "
            f"{self.fraction:.0%}"
        )
        if kind == "vision":
            return (
                f"{head}. A vision model's encoder and image buffers cannot be swapped out: "
                "above the gate it risks an out-of-memory crash. Use a smaller quantization, "
                "a smaller --ctx or fewer --slots, or raise vision_gate (e.g. "
                "ELBOWROOM_VISION_GATE=0.8) if you accept the risk."
            )
        return f"{head}. A text model above it is loaded, but expect swapping and slowness."

    def details(self) -> dict[str, object]:
        return {
            "model": self.model,
            "needed": self.footprint,
            "pool_limit": self.pool_limit,
            "vision_gate": self.fraction,
            "share": round(self.share, 4),
            "pool": self.pool,
        }


def gate(model: str, vision: bool, footprint: int, pool_limit: int, fraction: float) -> GateCheck:
    """PURE: the vision gate's verdict for a load of ``footprint`` bytes into a pool whose
    limit is ``pool_limit``. A fraction of 1 or more turns the gate off."""
    above = fraction < 1 and footprint > fraction * pool_limit
    verdict = Verdict.OK if not above else (Verdict.REFUSE if vision else Verdict.WARN)
    return GateCheck(verdict, model, footprint, pool_limit, fraction)


def enforce(check: GateCheck) -> None:
    """Raise 507 for a refused vision model; log a warning for a text model above the gate."""
    if check.verdict is Verdict.REFUSE:
        raise InsufficientMemory(check.message(), code="vision_gate", details=check.details())
    if check.verdict is Verdict.WARN:
        log.warning("%s", check.message())

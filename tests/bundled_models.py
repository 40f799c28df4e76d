"""The bundled models for tests: their specs as ``elbowroom.models.bundled`` builds them.

Import it as ``from bundled_models import bundled_spec`` (pyproject puts tests/ on sys.path).
One place knows where each package keeps its files, so a test loads exactly what the server
would; a test that needs a variant (another path, no tokenizer) takes
``dataclasses.replace`` of the real spec.
"""

from __future__ import annotations

import functools

import pytest

from elbowroom.config import Settings, load_settings
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.piper import PiperEngine
from elbowroom.engines.requests import SpeechRequest
from elbowroom.models.bundled import bundled_specs
from elbowroom.models.spec import GGUFInfo, ModelSpec


@functools.cache
def _default_specs() -> dict[str, ModelSpec]:
    return {spec.id: spec for spec in bundled_specs(load_settings(environ={}))}


def bundled_spec(model_id: str, settings: Settings | None = None) -> ModelSpec:
    """The installed bundled model ``model_id``; ``settings`` only matters for gemma3-270m
    (its assembled file lives in ``settings.data_dir``; default: the default data dir)."""
    if settings is None:
        specs = _default_specs()
    else:
        specs = {spec.id: spec for spec in bundled_specs(settings)}
    if model_id not in specs:
        raise LookupError(
            f"the bundled model {model_id} is not installed (or not prepared); "
            f"installed: {', '.join(specs) or 'none'}"
        )
    return specs[model_id]


def speak(text: str, *formats: str) -> list[bytes]:
    """``text`` spoken by the bundled piper voice (real synthesis), once per audio format:
    speech with a known transcript for the speech-to-text tests. Skips without piper."""
    pytest.importorskip("piper")
    voice = PiperEngine()
    voice.load(bundled_spec("piper-en-us-joe"), EngineOptions())
    try:
        return [
            voice.run(
                "speech",
                SpeechRequest(input=text, response_format=fmt),
                lambda _: None,
                lambda: False,
            )["audio"]
            for fmt in formats
        ]
    finally:
        voice.close()


# SmolLM2-135M's GGUF metadata (what read_gguf_info reads from the bundled file, less
# n_params), written out for the pure footprint tests, which open no file.
SMOLLM2_INFO = GGUFInfo(
    architecture="llama",
    name="smollm2-135m",
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    head_dim_k=64,
    head_dim_v=64,
    n_embd=576,
    trained_ctx=8192,
    file_type="Q4_1",
    has_chat_template=True,
    n_vocab=49152,
    n_ff=1536,
    tensor_bytes=96_576_768,
    matmul_bytes=(("Q4_1", 66_355_200), ("Q8_0", 30_081_024)),  # tied: token_embd too
)
# gemma3-270m's (Q4_K_M): sliding window 512 on 5 of every 6 layers, a 262,144 vocabulary.
GEMMA3_INFO = GGUFInfo(
    architecture="gemma3",
    name="gemma3-270m",
    n_layers=18,
    n_heads=4,
    n_kv_heads=1,
    head_dim_k=256,
    head_dim_v=256,
    n_embd=640,
    trained_ctx=32768,
    file_type="Q4_K_M",
    has_chat_template=False,
    sliding_window=512,
    n_vocab=262144,
    n_ff=2048,
    tensor_bytes=246_587_904,
    matmul_bytes=(
        ("Q4_K", 13_271_040),
        ("Q5_0", 43_591_680),
        ("Q6_K", 9_676_800),
        ("Q8_0", 179_824_640),  # token_embd too: tied, it is the output projection
    ),
)

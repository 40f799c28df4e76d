"""The engine registry: an engine's name (``ModelSpec.engine``) to its class.

Apart from the protocol (engines/base.py) so that the engines import ``base`` and only
this module imports the engines: no cycle. Each engine is imported lazily, so a runner
imports only its own library.
"""

from __future__ import annotations

from elbowroom.engines.base import Engine, PressureLevel


def create_engine(name: str, pressure: PressureLevel = lambda: 0) -> Engine:
    """Import lazily: a runner imports only its own library. ``pressure`` reads the
    runner's current memory pressure level (the LLM engine refuses and aborts generations
    on hard pressure)."""
    if name == "llama":
        from elbowroom.engines.llama import LlamaEngine

        return LlamaEngine(pressure)
    if name == "llama-rpc":  # a model split over nodes (docs/cluster.md)
        from elbowroom.engines.llama_rpc import RpcLlamaEngine

        return RpcLlamaEngine(pressure)
    if name == "mlx":  # MLX models (docs/mlx.md): the mlx extra
        from elbowroom.engines.mlx import MlxEngine

        return MlxEngine(pressure)
    if name == "whisper":
        from elbowroom.engines.whisper import WhisperEngine

        return WhisperEngine()
    if name == "pocketsphinx":
        from elbowroom.engines.sphinx import SphinxEngine

        return SphinxEngine()
    if name == "piper":
        from elbowroom.engines.piper import PiperEngine

        return PiperEngine()
    if name == "onnx-embed":
        from elbowroom.engines.embed import OnnxEmbedEngine

        return OnnxEmbedEngine()
    raise ValueError(f"unknown engine {name!r}")

"""PURE: what a runner's engine is loaded with — one frozen options object per engine kind.

The scheduler builds them (``scheduler/sizing.start_options``; a split model's in
``cluster/router.py`` and ``cluster/splitter.py``); they travel pickled with the spec to
the runner process and reach ``Engine.load`` as they are. Each engine takes its own kind
and refuses another (``expect``), so a key the engine does not read cannot be set, and
mypy checks every reader and writer.

- ``EngineOptions``: what every engine reads (whisper, pocketsphinx, piper and onnx-embed
  read nothing more);
- ``LlamaOptions``: the LLM engine (engines/llama.py): context, slots, KV cache, offload;
- ``RpcLlamaOptions``: a model split over nodes (engines/llama_rpc.py, docs/cluster.md);
- ``MlxOptions``: an MLX model (engines/mlx.py, docs/mlx.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from elbowroom.errors import EngineError


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOptions:
    threads: int | None = None  # None: the engine's own default
    log_level: str = "info"  # set by the supervisor from the settings of its machine
    # The runner's own memory ceiling (RLIMIT_DATA: writable private memory, which the
    # model's read-only mmap is not); 0: none. scheduler/sizing.runner_ceiling.
    memory_ceiling: int = 0


@dataclass(frozen=True, slots=True)
class Offload:
    """Where an LLM's layers go (scheduler/placement.py decides)."""

    n_gpu_layers: int = 0
    # The GPUs the engine may see, by NVML (PCI) index; () hides them all (the CPU alone);
    # None leaves the process's view alone (no GPU pools, or unified memory).
    devices: tuple[int, ...] | None = None
    tensor_split: tuple[float, ...] | None = None  # layers per device, with several devices


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaOptions(EngineOptions):
    n_ctx: int = 2048  # tokens per slot
    slots: int = 1  # parallel sequences
    kv_type: str = "f16"  # config.KV_TYPES
    mlock: bool = False  # lock the weights in RAM
    cache_ram_bytes: int = 0  # the engine's RAM prompt cache: a grant from the budget
    # Count that cache from the engine's log (engines/llama_log.py): the runner's fd 2 goes
    # through a reader. Set for runner processes (scheduler/sizing.py); an engine loaded in
    # a process of its own making (a test, a benchmark) leaves that process's fd 2 alone.
    prompt_cache_log: bool = False
    kv_cache: bool = True  # the KV disk tier (kvcache/), with kv_cache_dir and kv_disk_max
    kv_cache_dir: str | None = None
    kv_disk_max: int = 0
    kv_block_tokens: int = 64
    preempt: bool = True  # kv_preempt: preempt a stream for a request that needs its prefix
    offload: Offload = field(default_factory=Offload)


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcLlamaOptions(LlamaOptions):
    rpc_servers: tuple[str, ...] = ()  # host:port of each node's rpc-server, in split order
    rpc_split: tuple[int, ...] = ()  # layers per RPC server, same order
    llama_server: str | None = None  # the RPC-enabled llama-server binary; None: the default


@dataclass(frozen=True, slots=True, kw_only=True)
class MlxOptions(EngineOptions):
    """The MLX engine (engines/mlx.py, docs/mlx.md)."""

    n_ctx: int = 2048  # tokens the slot's KV cache holds (allocated at load)
    slots: int = 1  # MLX serves one sequence at a time (requests queue in the runner)
    memory_limit: int = 0  # bytes: mx.set_memory_limit (the runner's grant); 0: MLX's own
    cache_limit: int = 0  # bytes MLX's buffer cache may keep (mx.set_cache_limit)
    cache_ram_bytes: int = 0  # the prompt cache's RAM tier: a grant from the budget
    kv_cache: bool = True  # the KV disk tier (kvcache/), with kv_cache_dir and kv_disk_max
    kv_cache_dir: str | None = None
    kv_disk_max: int = 0
    kv_block_tokens: int = 64


_Kind = TypeVar("_Kind", bound=EngineOptions)


def expect(options: EngineOptions, kind: type[_Kind], engine: str) -> _Kind:
    """``options`` as the kind ``engine`` is loaded with, or an EngineError naming both."""
    if not isinstance(options, kind):
        raise EngineError(
            f"the {engine} engine is loaded with {kind.__name__}, not {type(options).__name__}"
        )
    return options


def tensor_split_arg(layers: Sequence[int]) -> str:
    """``--tensor-split`` for whole repeating layers per device, in device order.

    llama.cpp splits ``n_layer + 1`` units by cumulative proportion (layer ``i`` goes to the
    first device whose cumulative share exceeds ``i / (n_layer + 1)``), the last unit being
    the output layer. Giving the last device one unit more puts exactly ``layers[k]``
    repeating layers on device ``k`` and the output layer on the last (checked against
    llama.cpp's own per-layer assignment in tests/e2e/test_split_engine.py)."""
    if not layers:
        raise ValueError("no device to split over")
    units = [*layers[:-1], layers[-1] + 1]
    return ",".join(str(n) for n in units)

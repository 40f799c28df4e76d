"""One frozen Settings. Precedence: CLI flags > ELBOWROOM_* environment > TOML file > defaults.

Every field is a knob; its environment name is ``ELBOWROOM_`` + the upper-cased field name
(e.g. ``ELBOWROOM_OVERRIDE_MEMORY=8GiB``) and its TOML key is the field name. The TOML file
is ``--config PATH``, else ``$ELBOWROOM_CONFIG``, else ``$XDG_CONFIG_HOME/elbowroom/config.toml``
when it exists. Sizes accept units (``8GiB``); durations are seconds. docs/configuration.md
lists every knob with its default.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from elbowroom.units import parse_size

# The KV cache element types llama.cpp is loaded with, smallest saving first: the one list
# the settings, the CLI flags, the estimate and the engine check against.
KV_TYPES = ("f16", "q8_0", "q4_0")


def _xdg(var: str, fallback: str) -> Path:
    value = os.environ.get(var)
    return Path(value) if value else Path.home() / fallback


def default_data_dir() -> Path:
    return _xdg("XDG_DATA_HOME", ".local/share") / "elbowroom"


def default_cache_dir() -> Path:
    return _xdg("XDG_CACHE_HOME", ".cache") / "elbowroom"


def default_config_file() -> Path:
    return _xdg("XDG_CONFIG_HOME", ".config") / "elbowroom" / "config.toml"


def _size(**kw: Any) -> Any:
    return field(metadata={"kind": "size"}, **kw)


def _paths(**kw: Any) -> Any:
    return field(metadata={"kind": "paths"}, **kw)


def _strs(**kw: Any) -> Any:
    return field(metadata={"kind": "strs"}, **kw)


@dataclass(frozen=True, slots=True)
class Settings:
    # --- server
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_keys: tuple[str, ...] = _strs(default=())  # more inference keys, one per client
    admin_key: str | None = None  # when set, only it opens /api, /metrics, /openapi.json
    log_level: str = "info"
    # The server's event loop: "auto" = uvloop where it is installed (a dependency on Linux
    # and macOS), else asyncio's; "uvloop" insists on it; "asyncio" is the standard loop.
    event_loop: str = "auto"
    # --- request safety (docs/security.md)
    allowed_hosts: tuple[str, ...] = _strs(default=())  # (): loopback names on loopback binds
    allowed_origins: tuple[str, ...] = _strs(default=())  # browser origins besides our own
    max_body: int = _size(default=32 * 1024**2)  # bytes of one JSON request body
    max_body_inflight: int = _size(default=128 * 1024**2)  # large JSON bodies held at once
    max_json_values: int = 100_000  # values (strings, numbers, objects...) in one JSON body
    max_json_depth: int = 64  # nesting of arrays/objects in one JSON body
    max_messages: int = 4096  # chat messages in one request
    max_chars: int = 4 * 1024**2  # characters of all strings in one JSON body
    max_stop: int = 4  # stop strings in one request
    max_stop_chars: int = 256  # characters of one stop string
    max_int_digits: int = 64  # digits of one JSON integer literal
    # JSON schemas compiled into a grammar (response_format, format, tools): all of them
    max_schema_bytes: int = _size(default=32 * 1024)  # their JSON
    max_schema_members: int = 256  # enum values, anyOf/oneOf branches, properties
    max_schema_repeat: int = 1024  # any one minItems/maxLength/{n,m} bound
    # Connections (docs/security.md): a request's head and each wait for its body's next
    # bytes must come within these seconds; at most max_connections open at once.
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 0  # 0: from the process's open-file limit, fds reserved
    queue_share: float = 0.5  # share of queue_size one API key may hold waiting
    # --- models
    data_dir: Path = field(default_factory=default_data_dir)
    models_dir: Path | None = None  # default: data_dir / "models"
    model_paths: tuple[Path, ...] = _paths(default=())
    default_model: str = "smollm2-135m"
    preload: tuple[str, ...] = _strs(default=())
    pin: tuple[str, ...] = _strs(default=())
    model_projectors: tuple[str, ...] = _strs(default=())  # vision: "ID=PATH" of an mmproj
    # --- LLM engine
    ctx: int | None = None  # None: sized from the KV budget
    max_ctx: int = 4096  # per slot: auto-sizing never goes above this (nor the trained context)
    min_ctx: int = 512  # auto-sizing refuses below this
    kv_type: str = "f16"
    slots: int = 4  # parallel sequences per LLM (continuous batching); each owns ctx tokens
    model_slots: tuple[str, ...] = _strs(default=())  # per-model overrides: "ID=N"
    mlock: bool = False
    threads: int | None = None
    max_tokens_cap: int = 4096  # hard cap on generated tokens for every request
    # Each CPU runner's RLIMIT_DATA: 1.5 x what its load was admitted for, + 1 GiB
    runner_memory_ceiling: bool = True
    # Before a GGUF loads, its chat template is rendered in a child process with these bounds
    # (CPU seconds, bytes); a template past them is refused (422 chat_template_unsafe).
    chat_template_check: bool = True
    chat_template_check_seconds: float = 3.0
    chat_template_check_memory: int = _size(default=256 * 1024**2)
    # --- lifetimes
    keep_alive: float = 300.0  # seconds an idle mmap (LLM) model stays loaded
    resident_idle: float = 300.0  # seconds an idle resident engine (whisper/piper/onnx) stays
    load_timeout: float = 180.0
    # seconds a load waits for loads paused under memory pressure before its 503 + Retry-After
    load_pause_wait: float = 15.0
    stop_grace: float = 5.0
    # How a runner process starts: "forkserver" (forked from a process that imported the
    # runner's code once) or "spawn" (a fresh interpreter each time; docs/runners.md)
    runner_start: str = "forkserver"
    crash_backoff_initial: float = 10.0
    crash_backoff_max: float = 300.0
    # --- scheduling
    queue_size: int = 16  # requests waiting per model (all its slots busy) before 503
    # --- memory
    override_memory: int | None = _size(default=None)
    os_reserve: int | None = _size(default=None)  # None: tiered by total size
    container_margin: int | None = _size(default=None)  # None: max(5 % of limit, 32 MiB)
    safety_margin: int = _size(default=256 * 1024**2)
    load_fraction: float = 0.85  # the load ceiling, below soft
    soft_fraction: float = 0.90
    hard_fraction: float = 0.95
    psi_soft: float = 10.0  # PSI some (%, the lower of avg10 and the last 2 s): soft
    psi_hard: float = 40.0  # ... and to hard
    memory_guard: bool = True
    monitor_interval: float = 1.0
    # The guard's pressure watch (docs/pressure.md): kernel events (cgroup v1 thresholds,
    # PSI triggers) wake a sample at once; samples every pressure_fast_interval s while soft/hard.
    pressure_events: bool = True
    pressure_fast_interval: float = 0.1
    # Soft when others' memory grows so fast that available runs out within this many s.
    pressure_horizon: float = 2.0
    monitor_history: float = 600.0
    # Give the server's free C heap back to the OS when its last runner stops (glibc
    # malloc_trim; memory/heap.py): freed request buffers otherwise stay mapped for good.
    trim_when_idle: bool = True
    unload_settle_timeout: float = 10.0  # wait this long for unloaded memory to show up
    # --- GPUs (docs/gpu.md)
    gpu_layers: int | None = None  # None: placed by VRAM; 0: CPU only; -1: all; N: N units
    gpu_reserve: int | None = _size(default=None)  # None: 512 MiB up to 16 GiB cards, else 1 GiB
    override_gpu_memory: int | None = _size(default=None)  # make every GPU look this small
    # --- uploads / inputs
    max_upload: int = _size(default=25 * 1024**2)
    max_speech_chars: int = 4096
    max_embedding_inputs: int = 256
    # --- vision (docs/models.md#vision)
    vision_gate: float = 0.70  # a vision model above this share of its pool's limit: 507
    vision_settle_factor: float = 1.5  # switching to a vision model: wait for this x its bytes
    max_images: int = 8  # images in one request
    max_image_bytes: int = _size(default=10 * 1024**2)  # bytes of one image (decoded base64)
    max_image_pixels: int = 25_000_000  # width x height of one image (decompression bombs)
    max_decoded_image_bytes: int = _size(default=256 * 1024**2)  # a request's images, decoded
    image_url_hosts: tuple[str, ...] = _strs(default=())  # hosts image_url may fetch from
    # --- KV prefix cache
    kv_cache: bool = True
    kv_cache_dir: Path | None = None  # default: cache dir / "kv"
    kv_ram_max: int = _size(default=512 * 1024**2)  # per runner, fixed at load (MLX: shrinks)
    # ... and at most this many times the LLM's own KV cache (every slot's context): a small
    # model's prompt cache need not take room a second model could use (docs/kvcache.md)
    kv_ram_kv_factor: float = 1.0
    kv_disk_max: int = _size(default=4 * 1024**3)
    kv_block_tokens: int = 64
    # A stream whose slot holds a long prefix another request needs is ended and resumed on
    # another slot (docs/kvcache.md#preempt)
    kv_preempt: bool = True
    # --- stored responses of /v1/responses (docs/api.md#responses): data dir / "responses"
    responses_ttl: float = 30 * 24 * 3600.0  # seconds a stored response is kept
    responses_max: int = _size(default=1024**3)  # bytes of all stored responses (oldest go)
    # --- cluster (docs/cluster.md; needs the `cluster` extra)
    cluster: str | None = None  # Ray address ("auto", "10.0.0.1:6379"); None: one machine
    cluster_poll: float = 0.5  # seconds between readings of every node's memory
    rpc_host: str = "127.0.0.1"  # where llama.cpp RPC servers bind: loopback/private only
    cluster_split: bool = True  # a model that fits on no node is split over nodes (RPC)
    rpc_bin_dir: Path | None = None  # rpc-server + llama-server; default: the cached build

    @property
    def models_path(self) -> Path:
        return self.models_dir if self.models_dir is not None else self.data_dir / "models"

    @property
    def kv_cache_path(self) -> Path:
        return self.kv_cache_dir if self.kv_cache_dir is not None else default_cache_dir() / "kv"

    @property
    def responses_path(self) -> Path:
        return self.data_dir / "responses"

    @property
    def measurements_path(self) -> Path:
        """Where measured footprints are remembered per model file."""
        return self.data_dir / "measured.json"

    def slots_for(self, model_id: str) -> int:
        """Parallel sequences of ``model_id``: its ``model_slots`` entry, else ``slots``."""
        for item in self.model_slots:
            name, _, n = item.partition("=")
            if name.strip() == model_id:
                return int(n)
        return self.slots

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name: f for f in fields(Settings)}


def _convert(name: str, raw: Any) -> Any:
    f = _FIELDS[name]
    kind = f.metadata.get("kind")
    annotation = str(f.type)
    if raw is None:
        return None
    if kind == "size":
        return parse_size(raw) if raw != "" else None
    if kind == "paths":
        items = raw.split(os.pathsep) if isinstance(raw, str) else list(raw)
        return tuple(Path(p).expanduser() for p in items if p)
    if kind == "strs":
        items = raw.split(",") if isinstance(raw, str) else list(raw)
        return tuple(str(s).strip() for s in items if str(s).strip())
    if annotation.startswith("bool"):
        if isinstance(raw, bool):
            return raw
        lowered = str(raw).strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected true/false, got {raw!r}")
    if annotation.startswith("int"):
        return int(raw)
    if annotation.startswith("float"):
        return float(raw)
    if annotation.startswith("Path"):
        return Path(str(raw)).expanduser()
    return str(raw)


class ConfigError(ValueError):
    pass


def load_settings(
    flags: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> Settings:
    """Merge defaults < TOML < environment < flags (flags whose value is None are unset)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}

    path = config_file or (Path(env["ELBOWROOM_CONFIG"]) if env.get("ELBOWROOM_CONFIG") else None)
    if path is None and default_config_file().exists():
        path = default_config_file()
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        for key, raw in data.items():
            name = key.replace("-", "_")
            _refuse_removed(name, f"{path}: setting {key!r}")
            if name not in _FIELDS:
                raise ConfigError(f"{path}: unknown setting {key!r}")
            values[name] = raw

    for name in REMOVED:
        if env.get("ELBOWROOM_" + name.upper()) is not None:
            _refuse_removed(name, f"ELBOWROOM_{name.upper()}")
    for name in _FIELDS:
        raw = env.get("ELBOWROOM_" + name.upper())
        if raw is not None:
            values[name] = raw

    for name, raw in (flags or {}).items():
        if raw is not None:
            _refuse_removed(name, f"setting {name!r}")
            if name not in _FIELDS:
                raise ConfigError(f"unknown setting {name!r}")
            values[name] = raw

    converted: dict[str, Any] = {}
    for name, raw in values.items():
        try:
            converted[name] = _convert(name, raw)
        except ValueError as exc:
            raise ConfigError(f"setting {name}: {exc}") from exc
    settings = Settings(**converted)
    _validate(settings)
    return settings


# Settings that existed and were removed: naming one is an error that says why.
REMOVED = {
    "direct_streams": "every chat and completion request is now relayed from the engine's "
    "own events (docs/runners.md, 'One request path'); there is no other path to choose",
}


def _refuse_removed(name: str, where: str) -> None:
    if name in REMOVED:
        raise ConfigError(f"{where} was removed: {REMOVED[name]}; delete it")


EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def _validate(s: Settings) -> None:
    if s.event_loop not in EVENT_LOOPS:
        raise ConfigError(
            f"event_loop must be one of {', '.join(EVENT_LOOPS)}, not {s.event_loop!r}"
        )
    if s.kv_type not in KV_TYPES:
        raise ConfigError(f"kv_type must be one of {', '.join(KV_TYPES)}, not {s.kv_type!r}")
    if not 0 < s.load_fraction < s.soft_fraction < s.hard_fraction <= 1:
        raise ConfigError("need 0 < load_fraction < soft_fraction < hard_fraction <= 1")
    if s.slots < 1 or s.queue_size < 0:
        raise ConfigError("slots must be >= 1, queue_size >= 0")
    for item in s.model_slots:
        name, eq, n = item.partition("=")
        if not eq or not name.strip() or not n.strip().isdigit() or int(n) < 1:
            raise ConfigError(f"model_slots entries are ID=N with N >= 1, not {item!r}")
    if s.ctx is not None and s.ctx < 16:
        raise ConfigError(f"ctx {s.ctx} is too small (minimum 16)")
    if s.gpu_layers is not None and s.gpu_layers < -1:
        raise ConfigError(f"gpu_layers is -1 (all), 0 (CPU) or a count, not {s.gpu_layers}")
    if not 0 < s.queue_share <= 1:
        raise ConfigError(f"queue_share must be in (0, 1], not {s.queue_share}")
    for name in ("max_body", "max_body_inflight", "max_json_values", "max_json_depth"):
        if getattr(s, name) < 1:
            raise ConfigError(f"{name} must be >= 1, not {getattr(s, name)}")
    for name in (
        "max_int_digits",
        "max_schema_bytes",
        "max_schema_members",
        "max_schema_repeat",
        "max_connections",
    ):
        if getattr(s, name) < 0:
            raise ConfigError(f"{name} must be >= 0, not {getattr(s, name)}")
    if s.header_timeout <= 0 or s.body_timeout <= 0:
        raise ConfigError("header_timeout and body_timeout must be > 0 seconds")
    for name in ("max_messages", "max_chars", "max_stop", "max_stop_chars"):
        if getattr(s, name) < 0:
            raise ConfigError(f"{name} must be >= 0, not {getattr(s, name)}")
    for item in s.model_projectors:
        name, eq, where = item.partition("=")
        if not eq or not name.strip() or not where.strip():
            raise ConfigError(f"model_projectors entries are ID=PATH, not {item!r}")
    if s.vision_gate <= 0:
        raise ConfigError(f"vision_gate must be > 0 (1 or more: off), not {s.vision_gate}")
    if s.vision_settle_factor < 0:
        raise ConfigError(f"vision_settle_factor must be >= 0, not {s.vision_settle_factor}")
    for name in ("max_images", "max_image_bytes", "max_image_pixels", "max_decoded_image_bytes"):
        if getattr(s, name) < 0:
            raise ConfigError(f"{name} must be >= 0, not {getattr(s, name)}")
    if s.runner_start not in ("forkserver", "spawn"):
        raise ConfigError(f"runner_start is forkserver or spawn, not {s.runner_start!r}")
    if s.kv_ram_kv_factor < 0:
        raise ConfigError(f"kv_ram_kv_factor must be >= 0, not {s.kv_ram_kv_factor}")
    if s.kv_block_tokens < 1:
        raise ConfigError(f"kv_block_tokens must be >= 1, not {s.kv_block_tokens}")
    if s.responses_ttl <= 0 or s.responses_max < 0:
        raise ConfigError("responses_ttl must be > 0 seconds and responses_max >= 0 bytes")
    if s.cluster_poll <= 0:
        raise ConfigError(f"cluster_poll must be > 0 seconds, not {s.cluster_poll}")
    from elbowroom.rpc_bind import RpcBindError, check_rpc_bind

    try:
        check_rpc_bind(s.rpc_host)
    except RpcBindError as exc:
        raise ConfigError(f"rpc_host: {exc}") from None

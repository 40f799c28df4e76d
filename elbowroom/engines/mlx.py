"""MLX engine: MLX-format models (mlx-community folders) through ``mlx-lm``, one per runner.

Apple's MLX on macOS (Metal, unified memory); its CPU build on Linux (``mlx[cpu]``). The
engine runs mlx-lm's model on elbowroom's own token loop, so everything around it is
elbowroom's, as for llama.cpp: the context and its KV cache (allocated for the whole context
at load, so memory does not grow while serving), the memory caps, cancellation between
prefill chunks and tokens, the hard-pressure abort (checked before every token), stop
strings, and the prompt cache (the slot's KV state kept across requests, plus the RAM and
disk tiers of ``kvcache.PrefixCache`` holding states saved with mlx-lm's
``save_prompt_cache``).

Memory (docs/mlx.md): ``mx.set_memory_limit`` is the runner's grant, ``mx.set_cache_limit``
caps the buffers MLX keeps for reuse at the compute estimate (``wired_limit`` on Metal). The
buffer cache is emptied after every request, under soft pressure and before closing.

One sequence at a time (``max_concurrent`` 1): requests queue in the runner (docs/mlx.md
says what mlx-lm's batch generation measured here). On a CPU the model computes in float32:
MLX's half-precision and quantized CPU kernels measured 10-60x slower.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from elbowroom.engines import events
from elbowroom.engines.base import Cancelled, Emit, PressureLevel
from elbowroom.engines.options import EngineOptions, MlxOptions, expect
from elbowroom.engines.requests import CloseTicket, Payload, TextRequest, TextTicket
from elbowroom.engines.stops import StopScanner
from elbowroom.errors import (
    BadRequest,
    ContextOverflow,
    EngineError,
    InsufficientMemory,
    MemoryPressure,
)
from elbowroom.kvcache import CacheKey
from elbowroom.kvcache.cache import PrefixCache, budget_for_level
from elbowroom.memory.types import Pressure
from elbowroom.models.mlx_meta import MLX_PREFILL_CHUNK, on_cpu
from elbowroom.models.spec import ModelSpec

log = logging.getLogger(__name__)

FALLBACK_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
FALLBACK_STOPS = ("\nUser:", "\nSystem:")


class MlxEngine:
    def __init__(self, pressure: PressureLevel = lambda: 0) -> None:
        self._pressure = pressure
        self._model: Any = None
        self._tok: Any = None
        self._cache: list[Any] = []  # the slot's KV cache, one entry per layer
        self._held: list[int] = []  # tokens whose KV the slot's cache holds
        self._n_ctx = 0
        self._prefix: PrefixCache | None = None
        self._ram_max = 0
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._lock = threading.Lock()
        # Held while a request uses the model and its cache; relieve (on its own thread)
        # saves the slot's state only when it can take it at once.
        self._run_lock = threading.Lock()
        self._busy = 0
        self._served = 0
        self._generated = 0  # tokens generated since load (all requests)
        self._limits: dict[str, int] = {}
        self._preallocated = False
        self.max_concurrent = 1

    # ---- lifecycle ---------------------------------------------------------------------

    def load(self, spec: ModelSpec, options: EngineOptions) -> dict[str, Any]:
        opts = expect(options, MlxOptions, "mlx")
        try:
            mx = _mod("mlx.core")
            mlx_lm = _mod("mlx_lm")
        except ImportError as exc:
            raise EngineError(
                f"cannot load {spec.id}: the MLX engine needs the mlx extra "
                "(pip install 'elbowroom[mlx]'): " + str(exc)
            ) from exc
        if spec.mlx is None:
            raise EngineError(f"{spec.id} is not an MLX model folder")
        if opts.threads:
            os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
        if opts.memory_limit > 0:
            mx.set_memory_limit(opts.memory_limit)
            if not on_cpu():  # Metal: keep the model's pages wired within the grant
                with contextlib.suppress(Exception):
                    mx.set_wired_limit(min(opts.memory_limit, _max_wired(mx)))
        if opts.cache_limit > 0:
            mx.set_cache_limit(opts.cache_limit)
        self._limits = {"memory_limit": opts.memory_limit, "cache_limit": opts.cache_limit}
        try:
            # Not lazy: a lazily loaded tensor is not resident until first used, so the
            # measurement right after load would miss it. (On a CPU a half-precision model
            # holds both copies of its weights while they are converted: docs/mlx.md.)
            model, tok = mlx_lm.load(str(spec.path))
            if on_cpu():
                model.set_dtype(mx.float32)  # CPU kernels: float32 is the fast path
            mx.eval(model.parameters())
        except (MemoryError, RuntimeError) as exc:
            if "memory" in str(exc).lower() or isinstance(exc, MemoryError):
                raise InsufficientMemory(
                    f"MLX could not allocate {spec.id} within its grant of "
                    f"{opts.memory_limit} bytes: {exc}",
                    code="engine_load_failed",
                ) from exc
            raise EngineError(f"MLX could not load {spec.id}: {exc}") from exc
        except (ValueError, KeyError, OSError) as exc:
            raise EngineError(f"MLX could not load {spec.id}: {exc}") from exc
        n_tokens = len(getattr(tok, "_tokenizer", tok))
        if n_tokens > spec.mlx.vocab:
            # An id past the embedding table crashes MLX's CPU gather (SIGSEGV), not a raise.
            raise EngineError(
                f"cannot load {spec.id}: its tokenizer has {n_tokens} tokens, the model's "
                f"vocabulary only {spec.mlx.vocab}"
            )
        self._model, self._tok = model, tok
        self._n_ctx = opts.n_ctx
        self._cache = self._new_cache(mx)
        mx.clear_cache()
        version = f"mlx {mx.__version__}, mlx-lm {getattr(mlx_lm, '__version__', '?')}"
        if opts.kv_cache and self._preallocated:
            self._tmp = tempfile.TemporaryDirectory(prefix="elbowroom-mlx-")
            key = CacheKey(spec.identity, self._n_ctx, "model", engine=version)
            self._ram_max = opts.cache_ram_bytes
            disk = Path(opts.kv_cache_dir) if opts.kv_cache_dir else None
            self._prefix = PrefixCache(
                key,
                block_tokens=opts.kv_block_tokens,
                ram_budget=opts.cache_ram_bytes,
                disk_dir=disk,
                disk_max=opts.kv_disk_max,
            )
        return {
            "n_ctx": self._n_ctx,
            "slots": 1,
            "n_ctx_total": self._n_ctx,
            "n_ctx_train": spec.mlx.trained_ctx,
            "kv_type": "f32" if on_cpu() else "model",
            "chat_template": bool(getattr(tok, "chat_template", None)),
            "native_tools": False,
            "cache_ram_mib": opts.cache_ram_bytes >> 20,
            "engine": version,
            "device": "cpu" if on_cpu() else "gpu",
            "vision": False,
        }

    def _new_cache(self, mx: Any) -> list[Any]:
        """The model's cache, each plain KV layer allocated for the whole context now: the
        footprint counts it, and a cache that grows by concatenation holds two copies
        while it grows."""
        caches = _mod("mlx_lm.models.cache")
        kv_class = caches.KVCache

        cache: list[Any] = caches.make_prompt_cache(self._model)
        self._preallocated = all(type(c) is kv_class for c in cache)
        if not self._preallocated:
            return cache
        args: Any = self._model.args
        heads = int(getattr(args, "num_key_value_heads", 0) or args.num_attention_heads)
        hidden = int(args.hidden_size)
        head_dim = int(getattr(args, "head_dim", 0) or hidden // int(args.num_attention_heads))
        dtype = _float_dtype(mx, self._model)
        step = int(kv_class.step)
        cells = -(-max(1, self._n_ctx) // step) * step
        for c in cache:
            c.keys = mx.zeros((1, heads, cells, head_dim), dtype)
            c.values = mx.zeros((1, heads, cells, head_dim), dtype)
            c.offset = 0
        mx.eval([c.keys for c in cache] + [c.values for c in cache])
        return cache

    def stats(self) -> dict[str, Any]:
        with self._lock:
            busy, served, generated = self._busy, self._served, self._generated
        out: dict[str, Any] = {
            "slots": 1,
            "slots_busy": busy,
            "requests_served": served,
            "tokens_generated": generated,
            "prompt_cache_grant": self._ram_max,
        }
        try:
            mx = _mod("mlx.core")

            out["mlx"] = {
                "active": int(mx.get_active_memory()),
                "cache": int(mx.get_cache_memory()),
                "peak": int(mx.get_peak_memory()),
                **self._limits,
            }
        except ImportError:
            pass
        if self._prefix is not None:
            out["kv_cache"] = self._prefix.stats()
        return out

    def relieve(self, level: int) -> None:
        """Pressure rose: give MLX's cached buffers back, shrink the prompt cache's RAM tier
        (what no longer fits spills to disk) and save the slot's state there."""
        if self._prefix is not None:
            self._prefix.set_ram_budget(budget_for_level(level, self._ram_max))
            if self._run_lock.acquire(blocking=False):  # idle: nothing uses the cache
                try:
                    self._save_slot()
                finally:
                    self._run_lock.release()
        _mod("mlx.core").clear_cache()  # last: saving the state allocated buffers too

    def close(self, *, process_exit: bool = False) -> None:
        if self._prefix is not None:
            if self._pressure() < Pressure.HARD:
                try:
                    self._save_slot()
                    self._prefix.flush()  # the disk tier outlives this process
                except Exception:
                    log.exception("saving the prompt cache to the KV disk tier failed")
            self._prefix.close()
            self._prefix = None
        self._model = None
        self._cache = []
        with contextlib.suppress(ImportError):
            mx = _mod("mlx.core")

            mx.clear_cache()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ---- prompt cache ------------------------------------------------------------------

    def _save_slot(self) -> None:
        """Store the slot's KV state (its prompt and reply) in the prompt cache."""
        prefix, held = self._prefix, list(self._held)
        if prefix is None or len(held) < 2 or not prefix.wants(held):
            return
        blob = self._serialize(len(held))
        if blob is not None:
            prefix.store(held, blob)

    def _serialize(self, n: int) -> bytes | None:
        mx = _mod("mlx.core")
        caches = _mod("mlx_lm.models.cache")

        assert self._tmp is not None
        parts = []
        for c in self._cache:
            part = caches.KVCache()
            part.keys, part.values, part.offset = c.keys[..., :n, :], c.values[..., :n, :], n
            parts.append(part)
        path = Path(self._tmp.name) / "save.safetensors"
        try:
            mx.eval([p.keys for p in parts] + [p.values for p in parts])
            caches.save_prompt_cache(str(path), parts, {"tokens": str(n)})
            data: bytes = path.read_bytes()
            return data
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("could not save the prompt cache: %s", exc)
            return None
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _apply(self, blob: bytes | bytearray, n: int) -> bool:
        """Load a saved state (mlx-lm's load_prompt_cache) into the slot's cache, keeping
        its first ``n`` tokens."""
        mx = _mod("mlx.core")
        load_prompt_cache = _mod("mlx_lm.models.cache").load_prompt_cache

        assert self._tmp is not None
        path = Path(self._tmp.name) / "load.safetensors"
        try:
            path.write_bytes(blob)
            loaded = load_prompt_cache(str(path))
            if len(loaded) != len(self._cache):
                return False
            for dst, src in zip(self._cache, loaded, strict=True):
                keys, values = src.state[0], src.state[1]
                if keys.shape[2] < n or keys.shape[1:2] != dst.keys.shape[1:2]:
                    return False
                dst.keys[..., :n, :] = keys[..., :n, :].astype(dst.keys.dtype)
                dst.values[..., :n, :] = values[..., :n, :].astype(dst.values.dtype)
                dst.offset = n
            mx.eval([c.keys for c in self._cache] + [c.values for c in self._cache])
            return True
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            log.warning("could not restore a saved prompt cache: %s", exc)
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _reuse(self, prompt: list[int], isolated: bool) -> tuple[int, bool]:
        """How many leading prompt tokens the slot's cache holds after reusing what it can:
        its own state, else a stored prefix (restore vs recompute by the cost model)."""
        keep = 0
        if not isolated:
            keep = min(_common(self._held, prompt), len(prompt) - 1)
        if self._prefix is not None and not isolated:
            if keep < len(self._held) and keep < len(prompt) - 1:
                self._save_slot()  # the slot's conversation is about to be overwritten
            hit = self._prefix.lookup(prompt, live=keep)
            if hit is not None:
                n = hit.n_tokens
                if self._prefix.restore(hit, lambda blob: self._apply(blob, n)):
                    self._held = prompt[:n]
                    return n, True
                keep = 0  # a failed restore may have touched the cache
        for c in self._cache:
            c.offset = keep
        self._held = prompt[:keep]
        return keep, False

    # ---- requests ----------------------------------------------------------------------

    def run(self, op: str, payload: Payload, emit: Emit, cancelled: Cancelled) -> dict[str, Any]:
        if self._model is None:
            raise EngineError("the model is not loaded")
        if op == "close" and isinstance(payload, CloseTicket):
            return {}
        if op != "open" or not isinstance(payload, TextRequest):
            raise BadRequest(f"the mlx engine serves open with a TextRequest, not {op!r}")
        _refuse_unsupported(payload)
        if self._pressure() >= Pressure.HARD:
            raise MemoryPressure(
                "memory pressure is hard: no new generation starts; retry later or free memory",
                code="memory_pressure",
            )
        with self._lock:
            self._busy += 1
        try:
            with self._run_lock:
                if self._prefix is not None:  # back to the whole grant once pressure eased
                    self._prefix.set_ram_budget(budget_for_level(self._pressure(), self._ram_max))
                try:
                    return self._events(payload, emit, cancelled)
                finally:
                    if payload.isolated:  # cache_salt: its state is reused by nobody
                        self._held = []
        finally:
            mx = _mod("mlx.core")

            mx.clear_cache()  # what MLX kept for reuse goes back before anyone measures
            with self._lock:
                self._busy -= 1
                self._served += 1

    def _events(self, req: TextRequest, emit: Emit, cancelled: Cancelled) -> dict[str, Any]:
        """``open``: no HTTP server here, so the events follow over the runner, in the shape
        llama.cpp's server streams (engines/events.py): the relay reads both alike."""
        block = self._prefix.block_tokens if self._prefix is not None else 1
        emit({"type": "ticket", "ticket": TextTicket(ticket=0, socket=None, block_tokens=block)})

        def send(delta: dict[str, Any]) -> None:
            emit({"type": "events", "data": events.piece(req.kind, str(delta["text"]))})

        result = self._generate(req, send, cancelled)
        emit({"type": "events", "data": events.ending(req.kind, *result)})
        return {}

    def _prompt(self, req: TextRequest) -> tuple[list[int], tuple[str, ...]]:
        tok = self._tok
        if req.kind == "completion":
            return list(tok.encode(req.prompt)), ()
        messages = [_plain(m) for m in req.messages]
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(tok.encode(text, add_special_tokens=False)), ()
        return list(tok.encode(_fallback_prompt(messages))), FALLBACK_STOPS

    def _generate(
        self, req: TextRequest, emit: Emit, cancelled: Cancelled
    ) -> tuple[str, dict[str, int]]:
        mx = _mod("mlx.core")
        sampling = _mod("mlx_lm.sample_utils")

        prompt, extra_stops = self._prompt(req)
        if not prompt:
            raise BadRequest("the prompt is empty")
        if len(prompt) >= self._n_ctx:
            raise ContextOverflow(
                f"prompt is {len(prompt)} tokens; the context is {self._n_ctx} tokens and needs "
                "at least 1 free for the reply. Shorten the prompt or load the model with a "
                "larger --ctx.",
                details={"prompt_tokens": len(prompt), "n_ctx": self._n_ctx},
            )
        if req.seed is not None:
            mx.random.seed(req.seed)
        temp = 0.8 if req.temperature is None else req.temperature
        sampler = sampling.make_sampler(temp=temp, top_p=req.top_p or 0.0)
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
        processors = sampling.make_logits_processors(
            logit_bias=bias or None,
            presence_penalty=req.presence_penalty or None,
            frequency_penalty=req.frequency_penalty or None,
        )
        model, cache = self._model, self._cache
        started = time.perf_counter()
        kept, restored = self._reuse(prompt, req.isolated)
        aborted = self._prefill(prompt, kept, cancelled)
        if aborted:
            return self._finish(aborted, kept, prompt, 0)
        prefill_s = time.perf_counter() - started
        if self._prefix is not None and len(prompt) - 1 - kept > 0 and not restored:
            self._prefix.observe_prefill(len(prompt) - 1 - kept, prefill_s)
        scanner = StopScanner((*req.stop, *extra_stops))
        detok = self._tok.detokenizer
        detok.reset()
        eos = set(getattr(self._tok, "eos_token_ids", ()) or ())
        history = mx.array(prompt)

        def step(fed: Any, hist: Any) -> Any:
            """The graph of the token after ``fed`` (lazy: nothing runs yet)."""
            logits = model(fed[None], cache=cache)[:, -1, :]
            for proc in processors:
                logits = proc(hist, logits)
            return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

        finish = "length"
        n_out = 0
        limit = min(req.max_tokens, self._n_ctx - len(prompt))
        # Pipelined as mlx-lm's generate_step: the next token's graph is queued
        # (async_eval) before this one is read, so Python's per-token work overlaps the
        # model's. Every token handed to the model is in ``_held`` from then on.
        nxt = step(mx.array(prompt[-1:]), history)
        mx.async_eval(nxt)
        self._held.append(prompt[-1])
        while limit > 0:
            if cancelled():
                finish = "cancelled"
                break
            if self._pressure() >= Pressure.HARD:
                finish = "pressure"
                break
            token = nxt
            more = n_out + 1 < limit
            if more:
                if processors:
                    history = mx.concatenate([history, token])
                nxt = step(token, history)
                mx.async_eval(nxt)
            t = int(token.item())
            n_out += 1
            self._generated += 1
            if more:
                self._held.append(t)
            if t in eos:
                finish = "stop"
                break
            detok.add_token(t)
            piece, stopped = scanner.feed(detok.last_segment)
            if piece:
                emit({"type": "delta", "text": piece})
            if stopped:
                finish = "stop"
                break
            if not more:
                break
        mx.eval(nxt)  # the queued step has written its KV: the cache holds ``_held``
        detok.finalize()
        if not scanner.stopped:
            piece, _ = scanner.feed(detok.last_segment)
            piece += scanner.flush()
            if piece:
                emit({"type": "delta", "text": piece})
        return self._finish(finish, kept, prompt, n_out)

    def _prefill(self, prompt: list[int], kept: int, cancelled: Cancelled) -> str | None:
        """Feed prompt[kept:-1] in chunks; the last token is the first decode step's input.
        Returns "cancelled" / "pressure" when the prefill stopped early."""
        mx = _mod("mlx.core")

        todo = prompt[kept:-1]
        for start in range(0, len(todo), MLX_PREFILL_CHUNK):
            if cancelled():
                return "cancelled"
            if self._pressure() >= Pressure.HARD:
                return "pressure"
            chunk = todo[start : start + MLX_PREFILL_CHUNK]
            self._model(mx.array(chunk)[None], cache=self._cache)
            mx.eval([c.keys for c in self._cache] + [c.values for c in self._cache])
            self._held.extend(chunk)
        return None

    def _finish(
        self, finish: str, kept: int, prompt: Sequence[int], n_out: int
    ) -> tuple[str, dict[str, int]]:
        if finish == "pressure":
            raise MemoryPressure(
                f"generation aborted: memory pressure is hard (after {n_out} tokens); retry "
                "later or free memory",
                code="memory_pressure",
            )
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n_out, "cached_tokens": kept}
        return finish, usage  # the relay rounds cached_tokens to whole blocks


def _mod(name: str) -> Any:
    """An MLX module, untyped (mlx and mlx-lm ship partial type information)."""
    return importlib.import_module(name)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _float_dtype(mx: Any, model: Any) -> Any:
    for _, p in _mod("mlx.utils").tree_flatten(model.parameters()):
        if p.dtype in (mx.float32, mx.float16, mx.bfloat16):
            return p.dtype
    return mx.float32


def _max_wired(mx: Any) -> int:
    info: dict[str, Any] = mx.metal.device_info()  # Metal only
    return int(info.get("max_recommended_working_set_size", 0)) or (1 << 62)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message with text content only (the engine has no vision)."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") not in (None, "text"):
                raise BadRequest("this MLX model takes text only (no images)", param="messages")
            texts.append(str(part.get("text", "")) if isinstance(part, dict) else str(part))
        content = "".join(texts)
    out = {"role": message.get("role", "user"), "content": content or ""}
    return out


def _fallback_prompt(messages: list[dict[str, Any]]) -> str:
    lines = []
    for m in messages:
        role = str(m.get("role", "user"))
        lines.append(f"{FALLBACK_ROLES.get(role, role.capitalize())}: {m.get('content') or ''}")
    return "\n".join([*lines, "Assistant:"])


_UNSUPPORTED: tuple[tuple[str, Callable[[TextRequest], bool]], ...] = (
    (
        "response_format",
        lambda r: (
            r.response_format is not None and r.response_format.get("type") not in (None, "text")
        ),
    ),
    ("tools", lambda r: bool(r.tools)),
    ("logprobs", lambda r: r.logprobs is not None),
)


def _refuse_unsupported(req: TextRequest) -> None:
    """A field the MLX engine cannot honour is a 400, never silently ignored."""
    for name, present in _UNSUPPORTED:
        if present(req):
            raise BadRequest(
                f"{name} is not supported for MLX models (the llama.cpp engine serves it for "
                "GGUF models)",
                param=name,
            )
    if any(m.get("role") == "tool" or m.get("tool_calls") for m in req.messages):
        raise BadRequest("tool messages are not supported for MLX models", param="messages")

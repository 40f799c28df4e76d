"""LLM engine on llama.cpp (llama-cpp-python), driven token by token.

We use llama-cpp-python's low-level pieces (``Llama.eval``, a sampler chain, the vocab)
instead of ``create_chat_completion`` so that cached-token counts, cancellation, the
pressure check and stop strings are exact and in one loop (``_generate``).

Seams for the KV prefix cache (kvcache/ plugs in here): ``_prepare_prefix(tokens)`` makes
the context hold a prefix of ``tokens`` and returns its length; ``_on_finished(tokens)``
sees the tokens the context holds after a request. Both keep ``Llama.n_tokens`` /
``Llama.input_ids`` in agreement with the context.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from elbowroom.engines.base import Cancelled, Emit
from elbowroom.engines.llama_kv import LlamaKV
from elbowroom.engines.stops import StopScanner
from elbowroom.errors import (
    BadRequest,
    ContextOverflow,
    ElbowroomError,
    EngineError,
    InsufficientMemory,
    MemoryPressure,
)
from elbowroom.models.spec import ModelSpec

log = logging.getLogger(__name__)

KV_TYPES = ("f16", "q8_0", "q4_0")
PRESSURE_CHECK_EVERY = 16  # generated tokens between two looks at the pressure level
HARD = 2
DEFAULT_N_BATCH = 512
RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: pick a random seed

# Used for chat when the GGUF carries no chat template (base models such as gemma3 270m).
FALLBACK_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
FALLBACK_STOPS = ("\nUser:", "\nSystem:")


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]


class LlamaEngine:
    def __init__(self) -> None:
        self._llm: Any = None
        self._vocab: Any = None
        self._n_ctx = 0
        self._n_swa = 0
        self._formatter: Any = None  # Jinja2ChatFormatter from the GGUF template, or None
        self._max_tokens_cap: int | None = None
        self._seed = RANDOM_SEED
        self._pressure: Callable[[], int] = lambda: 0
        self._kv: LlamaKV | None = None  # the KV prefix cache (kvcache/), when enabled

    # ---- lifecycle ---------------------------------------------------------------------

    def load(self, spec: ModelSpec, options: dict[str, Any]) -> dict[str, Any]:
        import llama_cpp
        from llama_cpp import llama_cpp as lib

        kv_type = str(options.get("kv_type") or "f16")
        if kv_type not in KV_TYPES:
            raise BadRequest(f"kv_type must be one of {', '.join(KV_TYPES)}, not {kv_type!r}")
        ggml_type = {
            "f16": lib.GGML_TYPE_F16,
            "q8_0": lib.GGML_TYPE_Q8_0,
            "q4_0": lib.GGML_TYPE_Q4_0,
        }
        n_ctx = int(options.get("n_ctx") or 2048)
        threads = options.get("threads")
        self._pressure = options.get("pressure") or (lambda: 0)
        cap = options.get("max_tokens_cap")
        self._max_tokens_cap = int(cap) if cap else None
        seed = options.get("seed")
        self._seed = int(seed) if seed is not None else RANDOM_SEED
        try:
            self._llm = llama_cpp.Llama(
                model_path=str(spec.path),
                n_ctx=n_ctx,
                n_batch=min(n_ctx, DEFAULT_N_BATCH),
                n_threads=int(threads) if threads else None,
                n_threads_batch=int(threads) if threads else None,
                use_mmap=True,
                use_mlock=bool(options.get("mlock", False)),
                type_k=ggml_type[kv_type],
                type_v=ggml_type[kv_type],
                # llama.cpp refuses a quantized V cache without flash attention.
                flash_attn=bool(options.get("flash_attn", kv_type != "f16")),
                seed=self._seed,
                verbose=False,
            )
        except ValueError as exc:  # missing file
            raise EngineError(f"cannot load {spec.id}: {exc}") from exc
        except RuntimeError as exc:  # llama.cpp could not allocate the model or context
            raise InsufficientMemory(
                f"llama.cpp could not load {spec.id} with n_ctx={n_ctx}, kv_type={kv_type}: "
                f"{exc}. Try a smaller --ctx or --kv-type q8_0."
            ) from exc
        llm = self._llm
        self._vocab = lib.llama_model_get_vocab(llm.model)
        self._n_ctx = llm.n_ctx()
        self._n_swa = int(lib.llama_model_n_swa(llm.model))
        self._formatter = _template_formatter(llm)
        self._kv = LlamaKV.from_options(
            spec,
            options,
            llm,
            kv_type=kv_type,
            flash_attn=bool(options.get("flash_attn", kv_type != "f16")),
            n_swa=self._n_swa,
            trim=self._trim_context,
            pressure=self._pressure,
        )
        return {
            "n_ctx": self._n_ctx,
            "n_ctx_train": int(llm._model.n_ctx_train()),
            "kv_type": kv_type,
            "chat_template": self._formatter is not None,
        }

    def stats(self) -> dict[str, Any]:
        return {"kv_cache": self._kv.stats()} if self._kv is not None else {}

    def close(self) -> None:
        if self._kv is not None:
            self._kv.close()  # flushes the RAM tier to disk
            self._kv = None
        if self._llm is not None:
            self._llm.close()
            self._llm = None

    # ---- requests ----------------------------------------------------------------------

    def run(
        self, op: str, payload: dict[str, Any], emit: Emit, cancelled: Cancelled
    ) -> dict[str, Any]:
        if self._llm is None:
            raise EngineError("the model is not loaded")
        if op not in ("chat", "completion"):
            raise BadRequest(f"the llama engine does not serve {op!r} (chat, completion)")
        tokens, extra_stops = self._tokenize(op, payload)
        sampling = self._sampling(payload, len(tokens), extra_stops)
        try:
            return self._generate(tokens, sampling, emit, cancelled)
        except ElbowroomError:
            raise
        except RuntimeError as exc:  # llama_decode failed: out of KV slots or memory
            raise EngineError(f"llama.cpp failed while generating: {exc}") from exc

    def _generate(
        self, tokens: list[int], sampling: Sampling, emit: Emit, cancelled: Cancelled
    ) -> dict[str, Any]:
        """The one generation loop: prefix reuse, prefill, sample, stream, finish."""
        llm = self._llm
        n_cached = self._prepare_prefix(tokens)
        prefill_started = time.perf_counter()
        for start in range(n_cached, len(tokens), llm.n_batch):
            if cancelled():
                return self._finish(emit, StopScanner(()), [], tokens, n_cached, "cancelled")
            llm.eval(tokens[start : start + llm.n_batch])
        if self._kv is not None:  # the measured prefill speed decides restore vs recompute
            self._kv.observe_prefill(len(tokens) - n_cached, time.perf_counter() - prefill_started)

        sampler = self._sampler(sampling)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        scanner = StopScanner(sampling.stop)
        generated: list[int] = []
        finish = "length"
        try:
            for i in range(sampling.max_tokens):
                if cancelled():
                    finish = "cancelled"
                    break
                if i % PRESSURE_CHECK_EVERY == 0 and self._pressure() >= HARD:
                    raise MemoryPressure(
                        "generation aborted: memory pressure is hard "
                        f"(after {len(generated)} tokens); retry later or free memory",
                        code="memory_pressure",
                    )
                token = sampler.sample(llm._ctx, -1)
                if _is_eog(self._vocab, token):
                    finish = "stop"
                    break
                generated.append(token)
                text, stopped = scanner.feed(decoder.decode(self._piece(token)))
                if text:
                    emit({"type": "delta", "text": text})
                if stopped:
                    finish = "stop"
                    break
                if i + 1 < sampling.max_tokens:
                    llm.eval([token])
        finally:
            sampler.close()
        if not scanner.stopped:
            scanner.feed(decoder.decode(b"", final=True))
        return self._finish(emit, scanner, generated, tokens, n_cached, finish)

    def _finish(
        self,
        emit: Emit,
        scanner: StopScanner,
        generated: list[int],
        prompt: list[int],
        n_cached: int,
        finish: str,
    ) -> dict[str, Any]:
        rest = scanner.flush()
        if rest:
            emit({"type": "delta", "text": rest})
        llm = self._llm
        self._on_finished([int(t) for t in llm.input_ids[: llm.n_tokens]])
        return {
            "text": scanner.text,
            # "cancelled" only reaches in-process callers: a cancelled request's consumer is gone.
            "finish_reason": finish,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(generated),
                "cached_tokens": n_cached,
            },
        }

    # ---- KV prefix seams ---------------------------------------------------------------

    def _prepare_prefix(self, tokens: Sequence[int]) -> int:
        """Keep the longest prefix of ``tokens`` the context already holds; return its length.

        At least one prompt token is always left to evaluate: sampling needs fresh logits.
        """
        llm = self._llm
        held = llm.input_ids[: llm.n_tokens]
        limit = min(len(held), len(tokens) - 1)
        n = 0
        while n < limit and held[n] == tokens[n]:
            n += 1
        if self._kv is not None:  # a cached state may hold a longer prefix than the context
            n = self._kv.prepare(tokens, n)
        if n > 0 and self._trim_context(n):
            return n
        self._trim_context(0)
        return 0

    def _on_finished(self, tokens: list[int]) -> None:
        """Called after every request with the tokens the context now holds: their state
        becomes a KV prefix cache entry."""
        if self._kv is not None:
            self._kv.finished(tokens)

    def _trim_context(self, n: int) -> bool:
        """Drop context positions >= n. False when the KV memory cannot keep that prefix
        (e.g. a sliding-window cache that no longer holds the window before n)."""
        from llama_cpp import llama_cpp as lib

        llm = self._llm
        ctx = llm._ctx
        if not ctx.kv_cache_seq_rm(-1, n, -1):
            return False
        if n > 0:
            # A sliding-window cache may have dropped positions the prefix still attends to.
            oldest_needed = max(0, n - self._n_swa) if self._n_swa else 0
            if int(lib.llama_memory_seq_pos_min(ctx.memory, 0)) > oldest_needed:
                ctx.kv_cache_seq_rm(-1, 0, -1)
                llm.n_tokens = 0
                return False
        llm.n_tokens = n
        return True

    # ---- prompt and sampling -----------------------------------------------------------

    def _tokenize(self, op: str, payload: dict[str, Any]) -> tuple[list[int], tuple[str, ...]]:
        """The full prompt as tokens, plus stop strings the prompt format implies."""
        llm = self._llm
        extra: tuple[str, ...] = ()
        if op == "chat":
            messages = _messages(payload.get("messages"))
            if self._formatter is not None:
                try:
                    prompt = self._formatter(messages=messages).prompt
                except Exception as exc:  # the template's raise_exception or a Jinja error
                    raise BadRequest(
                        f"the model's chat template rejected the messages: {exc}",
                        param="messages",
                    ) from exc
                # The template writes BOS itself when the model wants one.
                tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
            else:
                prompt, extra = _fallback_prompt(messages), FALLBACK_STOPS
                tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
        else:
            prompt = payload.get("prompt")
            if not isinstance(prompt, str):
                raise BadRequest("prompt must be a string", param="prompt")
            tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        if not tokens:
            raise BadRequest("the prompt is empty", param="prompt" if op != "chat" else "messages")
        if len(tokens) > self._n_ctx - 1:
            raise ContextOverflow(
                f"prompt is {len(tokens)} tokens; the context is {self._n_ctx} tokens and needs "
                f"at least 1 free for the reply. Shorten the prompt or load the model with a "
                f"larger --ctx.",
                param="messages" if op == "chat" else "prompt",
                details={"prompt_tokens": len(tokens), "n_ctx": self._n_ctx},
            )
        return tokens, extra

    def _sampling(self, payload: dict[str, Any], n_prompt: int, extra: tuple[str, ...]) -> Sampling:
        room = self._n_ctx - n_prompt
        requested = payload.get("max_tokens")
        if requested is not None and (
            isinstance(requested, bool) or not isinstance(requested, int) or requested < 1
        ):
            raise BadRequest("max_tokens must be a positive integer", param="max_tokens")
        limit = room if requested is None else min(requested, room)
        if self._max_tokens_cap:
            limit = min(limit, self._max_tokens_cap)
        temperature = _number(payload, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(payload, "top_p", 1.0, 0.0, 1.0)
        seed = payload.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("seed must be an integer", param="seed")
        stop = payload.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)
        ):
            raise BadRequest("stop must be a string or a list of strings", param="stop")
        return Sampling(
            max_tokens=limit,
            temperature=temperature,
            top_p=top_p,
            seed=(seed & 0xFFFFFFFF) if seed is not None else self._seed,
            stop=tuple(s for s in (stop or []) if s) + extra,
        )

    def _sampler(self, s: Sampling) -> Any:
        from llama_cpp._internals import LlamaSampler

        make: Any = LlamaSampler  # its __init__ is untyped upstream
        sampler = make()
        if s.temperature == 0.0:
            sampler.add_greedy()
        else:
            if s.top_p < 1.0:
                sampler.add_top_p(s.top_p, 1)
            sampler.add_temp(s.temperature)
            sampler.add_dist(s.seed)
        return sampler

    def _piece(self, token: int) -> bytes:
        """The token's bytes (may be part of a UTF-8 character; the decoder joins them)."""
        from llama_cpp import llama_cpp as lib

        buf = ctypes.create_string_buffer(64)
        n = lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:  # buffer too small: -n is the size needed
            buf = ctypes.create_string_buffer(-n)
            n = lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]


def _is_eog(vocab: Any, token: int) -> bool:
    from llama_cpp import llama_cpp as lib

    return bool(lib.llama_vocab_is_eog(vocab, token))


def _template_formatter(llm: Any) -> Any:
    """A formatter for the GGUF's own chat template, or None when it has none."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        return None

    def text(token: int) -> str:
        return str(llm._model.token_get_text(token)) if token != -1 else ""

    return Jinja2ChatFormatter(
        template=template,
        eos_token=text(llm.token_eos()),
        bos_token=text(llm.token_bos()),
        add_generation_prompt=True,
    )


def _messages(raw: Any) -> list[dict[str, str]]:
    """Validate chat messages; flatten OpenAI content parts to text."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list", param="messages")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(f"messages[{i}] needs a string 'role'", param="messages")
        content = msg.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise BadRequest(
                        f"messages[{i}]: only text content parts are supported", param="messages"
                    )
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", param="messages")
        out.append({"role": msg["role"], "content": content})
    return out


def _fallback_prompt(messages: list[dict[str, str]]) -> str:
    """A plain transcript for models without a chat template:
    ``User: hi\\nAssistant: hello\\nUser: ...\\nAssistant:``."""
    lines = [
        f"{FALLBACK_ROLES.get(m['role'], m['role'].capitalize())}: {m['content']}" for m in messages
    ]
    return "\n".join([*lines, "Assistant:"])


def _number(payload: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = payload.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise BadRequest(f"{key} must be a number from {lo:g} to {hi:g}", param=key)
    return float(value)

"""LLM engine: llama.cpp's own server engine (``xllamacpp.Server``), one per runner.

The engine does continuous batching over ``slots`` sequences, prompt caching in RAM
(``cache_ram_mib``, a grant from elbowroom's budget), grammars / JSON schema, tool calling
through the chat template and logprobs. elbowroom owns everything around it: the context and
slot count, the cache grant, the pressure check, cancellation and error translation.

``open`` is the engine's only text operation: it picks and restores the request's slot,
builds llama.cpp's request and hands back a ``TextTicket``; the server posts it to the
engine's private socket and relays the engine's own SSE events (server/stream/relay.py), always a
stream on the engine side, also for clients that did not stream. Closing that connection
cancels the generation (client gone, hard-pressure abort); ``close`` gives the slot back.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from elbowroom.config import KV_TYPES
from elbowroom.engines import llama_log
from elbowroom.engines.base import Cancelled, Emit, PressureLevel
from elbowroom.engines.llama_control import EngineControl
from elbowroom.engines.llama_grammar import constrain, costly_tools
from elbowroom.engines.llama_log import PromptCacheLog
from elbowroom.engines.llama_slots import Holder, Slots
from elbowroom.engines.llama_tools import plan as plan_tools
from elbowroom.engines.options import EngineOptions, LlamaOptions, expect
from elbowroom.engines.requests import CloseTicket, Payload, TextRequest, TextTicket
from elbowroom.errors import (
    BadRequest,
    ContextOverflow,
    ElbowroomError,
    EngineError,
    InsufficientMemory,
    MemoryPressure,
    Unavailable,
    Unprocessable,
)
from elbowroom.kvcache import CacheKey
from elbowroom.memory.types import Pressure
from elbowroom.models.estimate import CTX_CHECKPOINTS
from elbowroom.models.spec import ModelSpec

log = logging.getLogger(__name__)

# Engines whose process exits without their destructor (LlamaEngine._drop).
_LEFT_FOR_EXIT: list[Any] = []

# Prompt batches: the engine reports progress once per batch, which bounds how long a
# cancellation waits during a long prefill. 512 is also the compute micro-batch.
N_BATCH = 512

# A preempted stream's continuation waits at most this long for the request that took its
# slot to decode its first token (its prefill then has the engine to itself: the
# continuation's restore and decode do not delay it), polling every HANDOFF_POLL_S. Each
# poll wakes the engine's HTTP thread and this one beside the engine's compute threads,
# which use every core of a CPU build: polled every 10 ms, a 14-token prefill of the
# dropped-stream benchmark took a median ~25 ms longer than polled every 50 ms
# (benchmarks/dropped_stream.py, 6 rounds each); the preempted stream's pause grows by at
# most one poll.
HANDOFF_WAIT_S = 2.0
HANDOFF_POLL_S = 0.05

# Used for chat when the GGUF carries no chat template (base models such as gemma3 270m).
FALLBACK_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
FALLBACK_STOPS = ["\nUser:", "\nSystem:"]


def select_gpus(devices: tuple[int, ...] | None) -> None:
    """Show the engine only the GPUs its placement uses (scheduler/placement.py); [] hides
    them all. llama.cpp makes a CUDA context (~0.6 GiB) on every GPU it can see, layers or
    not, so hiding is how a CPU-only model keeps off the GPUs. CUDA numbers devices
    fastest-first unless told otherwise; our pools use NVML's PCI bus order. Must run
    before the first CUDA call of this process (the runner hosts one model).
    """
    if devices is None:
        return
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(d)) for d in devices)


class LlamaEngine:
    def __init__(self, pressure: PressureLevel = lambda: 0) -> None:
        self._server: Any = None
        self._control: EngineControl | None = None
        self._n_ctx = 0  # per slot
        self._slots = 1
        self._chat_template = False
        self._native_tools = False
        self._pressure = pressure  # the runner's memory pressure level (runtime/worker.py)
        self._slot_pool: Slots | None = None
        self._cache_grant = 0  # bytes the engine's RAM prompt cache may hold
        # What the engine's log says of that cache (engines/llama_log.py); None: not read.
        self._cache_log: PromptCacheLog | None = None
        self._block = 1  # cached_tokens are reported in whole blocks of this many tokens
        self._lock = threading.Lock()
        self._active = 0
        self._served = 0
        # Tickets open now: ticket -> (slot, cache-isolated).
        self._tickets: dict[int, tuple[int, bool]] = {}
        self._next_ticket = 0
        # Requests relayed from the engine's socket, in all and by what the relay rewrites.
        self._socket_streams = {"all": 0, "logprobs": 0, "emulated_tools": 0, "transcript": 0}
        # Preempt and resume (server/stream/resume.py): ticket -> slot of the relayed streams that
        # may be preempted, and how the runner tells the server (set by the worker).
        self._resumable: dict[int, int] = {}
        # Preempted ticket -> (its slot, how many times that slot had been taken then):
        # its continuation waits for the request that takes the slot next (``_handoff``).
        self._handoffs: dict[int, tuple[int, int]] = {}
        self.notify: Callable[[dict[str, Any]], None] | None = None
        self.max_concurrent = 1

    # ---- lifecycle ---------------------------------------------------------------------

    def load(self, spec: ModelSpec, options: EngineOptions) -> dict[str, Any]:
        opts = expect(options, LlamaOptions, "llama")
        _check_has_tensors(spec)
        select_gpus(opts.offload.devices)
        import xllamacpp

        kv_type = opts.kv_type
        if kv_type not in KV_TYPES:
            raise BadRequest(f"kv_type must be one of {', '.join(KV_TYPES)}, not {kv_type!r}")
        self._n_ctx = opts.n_ctx
        self._slots = max(1, opts.slots)
        self.max_concurrent = self._slots
        self._chat_template = bool(spec.gguf is not None and spec.gguf.has_chat_template)

        control = self._control = EngineControl()
        version = str(getattr(xllamacpp, "__version__", "?"))
        key = CacheKey(spec.identity, self._n_ctx, kv_type, engine=f"xllamacpp {version}")
        slots = self._slot_pool = Slots.create(control, self._slots, key, opts)
        slots.holder = self._holder
        slots.may_preempt = opts.preempt
        # Reported cached_tokens are rounded down to whole cache blocks: exact counts would
        # let one client probe, token by token, what another client's prompt began with.
        self._block = slots.block_tokens
        params = xllamacpp.CommonParams()
        params.model.path = str(spec.path)
        params.n_ctx = self._n_ctx * self._slots  # each slot owns n_ctx (kv_unified off)
        params.n_parallel = self._slots
        params.kv_unified = False
        params.n_batch = N_BATCH
        params.n_ubatch = N_BATCH
        ggml = xllamacpp.ggml_type
        kv = {"f16": ggml.GGML_TYPE_F16, "q8_0": ggml.GGML_TYPE_Q8_0, "q4_0": ggml.GGML_TYPE_Q4_0}
        params.cache_type_k = kv[kv_type]
        params.cache_type_v = kv[kv_type]
        # llama.cpp refuses a quantized V cache without flash attention.
        fa = xllamacpp.llama_flash_attn_type
        params.flash_attn_type = (
            fa.LLAMA_FLASH_ATTN_TYPE_ENABLED if kv_type != "f16" else fa.LLAMA_FLASH_ATTN_TYPE_AUTO
        )
        if opts.threads:
            params.cpuparams.n_threads = opts.threads
            params.cpuparams_batch.n_threads = opts.threads
        if opts.mlock:  # the weights stay mapped and locked: the OS cannot drop them
            params.load_mode = xllamacpp.llama_load_mode.LLAMA_LOAD_MODE_MMAP_MLOCK
        # The RAM prompt cache is a grant from elbowroom's budget; the engine's default
        # (8 GiB) must never apply unbudgeted.
        params.cache_ram_mib = max(0, opts.cache_ram_bytes // (1 << 20))
        self._cache_grant = params.cache_ram_mib << 20
        params.n_gpu_layers = opts.offload.n_gpu_layers
        if spec.projector is not None:  # vision (models/vision.py)
            params.mmproj.path = str(spec.projector.path)
            # The projector is budgeted in host RAM: on a GPU its bytes would be VRAM the
            # offload plan does not count.
            params.mmproj_use_gpu = False
        else:
            params.no_mmproj = True
        if opts.offload.tensor_split:
            split = list(opts.offload.tensor_split)
            # The binding takes exactly llama.cpp's 128 entries (one per possible device).
            params.tensor_split = split + [0.0] * (128 - len(split))
        params.fit_params = False  # placement is elbowroom's budget, not the engine's guess
        # Sliding-window models snapshot their window per slot; llama.cpp's default of 32
        # snapshots would grow gemma3-270m by ~0.5 GiB a slot, unbudgeted (models/estimate.py).
        params.n_ctx_checkpoints = CTX_CHECKPOINTS
        params.ctx_shift = False  # a full context ends the reply ("length"); nothing is dropped
        params.hostnames = [control.socket]
        params.api_keys = [control.key]
        params.slot_save_path = slots.save_path
        params.endpoint_metrics = True
        params.verbosity = 0 if opts.log_level != "debug" else 3
        if not spec.path.is_file():
            control.cleanup()
            raise EngineError(f"cannot load {spec.id}: {spec.path} is not a readable file")
        verbose = params.verbosity >= 3
        # Before fd 2 is captured for the load.
        self._cache_log = self._read_log(params) if opts.prompt_cache_log else None
        with _CapturedStderr(llama_log.Shown(verbose)) as log_tail:
            try:
                self._server = self._start_server(params)
            except RuntimeError as exc:
                failure: RuntimeError | None = exc
            else:
                failure = None
        if failure is not None:
            control.cleanup()
            self._control = None
            raise _load_error(
                spec.id, log_tail.text(), self._n_ctx, self._slots, kv_type
            ) from failure
        props = self._props()
        caps = props.get("chat_template_caps") or {}
        self._native_tools = bool(caps.get("supports_tool_calls") or caps.get("supports_tools"))
        n_ctx_train = int((props.get("default_generation_settings") or {}).get("n_ctx", 0))
        return {
            "n_ctx": self._n_ctx,
            "slots": self._slots,
            "n_ctx_total": self._n_ctx * self._slots,
            "n_ctx_train": spec.gguf.trained_ctx if spec.gguf is not None else n_ctx_train,
            "kv_type": kv_type,
            "chat_template": self._chat_template,
            "native_tools": self._native_tools,
            "cache_ram_mib": params.cache_ram_mib,
            "engine": f"xllamacpp {version}",
            "vision": spec.projector is not None,
        }

    def _drop(self, server: Any, process_exit: bool) -> None:
        """Let go of the engine. Its destructor stops the engine loop and the HTTP listener,
        joins their threads and frees the model and contexts piece by piece: 30-70 ms for
        the bundled LLMs, which the next model of a swap waited for. When the process exits
        right after, the kernel frees all of it at once: the engine is left running."""
        if process_exit and server is not None:
            _LEFT_FOR_EXIT.append(server)

    def _read_log(self, params: Any) -> PromptCacheLog | None:
        """Read the engine's RAM prompt cache from its log (engines/llama_log.py): the log
        goes through the runner's reader, at the verbosity that writes those lines. A split
        model's engine (llama_rpc) logs to its own file: None there."""
        if params.cache_ram_mib <= 0:
            return None
        counts = llama_log.tap(verbose=params.verbosity >= 3)
        params.verbosity = max(params.verbosity, llama_log.VERBOSITY)
        return counts

    def _start_server(self, params: Any) -> Any:
        """The engine for ``params``; a split model's engine (llama_rpc) overrides it."""
        import xllamacpp

        return xllamacpp.Server(params)

    def _props(self) -> dict[str, Any]:
        assert self._control is not None
        try:
            props = self._control.request("GET", "/props")
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("could not read the engine's /props: %s", exc)
            return {}
        return props if isinstance(props, dict) else {}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            active, served = self._active, self._served
            socket_streams = dict(self._socket_streams)
        out: dict[str, Any] = {
            "slots": self._slots,
            "slots_busy": active,
            "requests_served": served,
            "socket_streams": socket_streams,
            "prompt_cache_grant": self._cache_grant,
        }
        if self._slot_pool is not None:
            out["kv_cache"] = self._slot_pool.stats()
        if self._cache_log is not None:  # the RAM tier: the engine's own prompt cache
            kv = {**out.get("kv_cache", {}), **self._cache_log.stats()}
            kv["ram_budget"] = self._cache_grant
            kv["hits"] = {"ram": kv["hits_ram"], "disk": int(kv.get("hits_disk", 0))}
            out["kv_cache"] = kv
        return out

    def relieve(self, level: int) -> None:
        """Pressure rose to ``level``: nothing is saved (dropped, not saved). A slot save runs
        on the engine's loop and writes the state into the page cache, then reads it back
        and stores it again: under pressure that stalled serving (16 s in a chaos run) and
        *added* two to three copies of each state to the cgroup's usage at the worst moment.
        The states stay in their slots and the engine's RAM prompt cache (a budgeted grant,
        given back by unloading the runner); an unload at soft still saves every slot when
        it closes the runner (``close``), one at hard saves none."""
        log.debug("memory pressure level %d: slot states are not saved under pressure", level)

    def close(self, *, process_exit: bool = False) -> None:
        if self._pressure() >= Pressure.HARD:
            # Memory is needed now: saving every slot takes 0.2-0.9 s before any of it comes
            # back (and under pressure idle slots are not saved either: ``relieve``).
            log.warning("memory pressure is hard: closing without saving slot states")
        elif self._slot_pool is not None and self._server is not None:
            try:
                self._slot_pool.save_all()  # the disk tier outlives this process
            except Exception:
                log.exception("saving slot states to the KV disk tier failed")
        server, self._server = self._server, None
        self._drop(server, process_exit)
        if self._control is not None:
            self._control.cleanup()
            self._control = None

    # ---- requests ----------------------------------------------------------------------

    def run(self, op: str, payload: Payload, emit: Emit, cancelled: Cancelled) -> dict[str, Any]:
        if self._server is None:
            raise EngineError("the model is not loaded")
        if op == "close" and isinstance(payload, CloseTicket):
            return self._close(payload)
        if op != "open" or not isinstance(payload, TextRequest):
            raise BadRequest(
                f"the llama engine serves open with a TextRequest and close, not {op!r} with "
                f"a {type(payload).__name__}"
            )
        if self._pressure() >= Pressure.HARD:  # refuse before spending a prefill on it
            raise MemoryPressure(
                "memory pressure is hard: no new generation starts; retry later or free memory",
                code="memory_pressure",
            )
        return {"ticket": self._open(payload)}

    def _open(self, request: TextRequest) -> TextTicket:
        """Prepare a request that the server sends to the engine's private socket itself (no
        token crosses the runner pipe): pick and prepare its slot, and hand back the engine
        request, always a stream. What the relay rewrites on the way is named in the
        ticket: emulated tool calls (parsed at the end), a chat answered from the
        no-template transcript (completion events)."""
        if request.resumed:  # first, before any of its own work shares the engine's cores
            self._handoff(request.resumed)
        body, emulated = self._body(request)
        chat = "messages" in body
        transcript = request.kind == "chat" and not chat
        assert self._control is not None
        slot, isolated = self._take_slot(body, request.isolated, chat, bool(request.resumed))
        if request.resumed:  # the preempted slot's state, saved at its close
            assert self._slot_pool is not None
            self._slot_pool.restore_state(slot, f"preempted-{request.resumed}.bin")
        with self._lock:
            ticket = self._next_ticket = self._next_ticket + 1
            self._tickets[ticket] = (slot, isolated)
            counts = self._socket_streams
            counts["all"] += 1
            counts["logprobs"] += request.logprobs is not None
            counts["emulated_tools"] += emulated
            counts["transcript"] += transcript
            if resumable(request) and not transcript:  # a transcript has no assistant turn
                self._resumable[ticket] = slot
        return TextTicket(
            ticket=ticket,
            socket=self._control.socket,
            key=self._control.key,
            path="/v1/chat/completions" if chat else "/v1/completions",
            body=body,
            block_tokens=self._block,
            emulated_tools=emulated,
            transcript=transcript,
        )

    def _close(self, closing: CloseTicket) -> dict[str, Any]:
        """A request's events ended (any way): give its slot back."""
        with self._lock:
            entry = self._tickets.pop(closing.ticket, None)
            self._resumable.pop(closing.ticket, None)
        if entry is None:
            return {"closed": False}
        control = self._control
        if closing.resume and control is not None:
            # Preempted: its continuation restores this state (server/stream/resume.py), so it is
            # saved now (the engine's save waits for the cancelled generation to stop),
            # before the slot goes to the request waiting for its prefix.
            assert self._slot_pool is not None
            log.info("preempt: ticket %d closed, saving slot %d", closing.ticket, entry[0])
            self._slot_pool.save_state(entry[0], f"preempted-{closing.ticket}.bin")
        elif closing.timings is None and control is not None:
            # Ended early (client gone, error): the engine's loop may still be on it (a
            # grammar being set up), so the slot stays taken and counted busy until the loop
            # lets go. The scheduler's claim goes now: an unload can still end a stuck engine.
            def settle() -> None:
                control.wait_slot_idle(entry[0])
                self._give_slot(*entry)

            threading.Thread(target=settle, name="settle-slot", daemon=True).start()
            return {"closed": True}
        self._give_slot(*entry)
        if closing.timings is not None:
            self._give_timings(closing.timings)
        return {"closed": True}

    def _holder(self, slot: int, preempt: bool) -> Holder:
        """What ``slot``, busy with a prompt a waiting request shares a long prefix with, is
        doing (Slots.acquire asks): not yet past its prefill, or generating; with
        ``preempt``, a generating slot held by a resumable relayed stream is preempted: the
        server is told to close that stream and resume it elsewhere (server/stream/resume.py)."""
        phase, cached = self._phase(slot)
        if phase in ("idle", "prefilling"):
            return Holder.PREFILLING
        if phase == "unknown":
            return Holder.KEPT  # the engine cannot be read: wait blind, as before
        notify = self.notify
        with self._lock:
            ticket = next((t for t, s in self._resumable.items() if s == slot), None)
        if not preempt or ticket is None or notify is None:
            return Holder.KEPT
        assert self._slot_pool is not None
        taken, _ = self._slot_pool.taken(slot)
        with self._lock:
            if self._resumable.pop(ticket, None) is None:
                return Holder.KEPT  # closed meanwhile
            self._handoffs[ticket] = (slot, taken)
            while len(self._handoffs) > 4 * self._slots:  # continuations that never came
                del self._handoffs[next(iter(self._handoffs))]
        # The prompt tokens the preempted request reused: its continuation restores them all,
        # and its usage would call them cached (server/stream/resume.py ``fix_usage``).
        notify({"preempt": ticket, "cached": cached})
        log.info("preempt: told the server to end ticket %d on slot %d", ticket, slot)
        return Holder.PREEMPTED

    def _handoff(self, preempted: int) -> None:
        """The continuation of the ``preempted`` ticket waits until the request that took
        its slot has decoded its first token, or has ended, at most HANDOFF_WAIT_S: the
        continuation's slot restore and its decode steps share the engine's one loop, so
        run at once they would delay the first token of the request the preemption was
        for. The preempted stream's pause grows by that request's (short) prefill."""
        with self._lock:
            handoff = self._handoffs.pop(preempted, None)
        pool = self._slot_pool
        if handoff is None or pool is None:
            return
        slot, before = handoff
        started = time.monotonic()
        how = "gave up"
        while time.monotonic() - started < HANDOFF_WAIT_S:
            taken, free = pool.taken(slot)
            if taken > before and (free or self._generating(slot)):
                how = "ended" if free else "generating"
                break
            time.sleep(HANDOFF_POLL_S)
        log.info(
            "preempt: the continuation of ticket %d waited %.0f ms for the request on slot %d (%s)",
            preempted,
            (time.monotonic() - started) * 1000,
            slot,
            how,
        )

    def _generating(self, slot: int) -> bool:
        """Whether the engine's ``slot`` has decoded a token (past its prefill)."""
        return self._phase(slot)[0] == "generating"

    def _phase(self, slot: int) -> tuple[str, int]:
        """The engine's ``slot``: "generating" (decoded a token), "prefilling" (processing,
        none decoded yet) or "idle" (not processing: the request taking it has not reached
        the engine yet, or it has ended); "unknown" when the engine cannot be read. And how
        many of its request's prompt tokens the engine reused (``n_prompt_tokens_cache``)."""
        assert self._control is not None
        try:
            slots = self._control.request("GET", "/slots", None)
        except (OSError, RuntimeError, ValueError) as exc:
            log.debug("cannot read the engine's slots: %s", exc)
            return "unknown", 0
        for entry in slots if isinstance(slots, list) else ():
            if isinstance(entry, dict) and entry.get("id") == slot:
                cached = int(entry.get("n_prompt_tokens_cache") or 0)
                if not entry.get("is_processing"):
                    return "idle", cached
                tokens = entry.get("next_token")
                first = tokens[0] if isinstance(tokens, list) and tokens else tokens
                decoded = first.get("n_decoded", 0) if isinstance(first, dict) else 0
                return ("generating" if int(decoded) > 0 else "prefilling"), cached
        return "idle", 0

    # ---- slots ------------------------------------------------------------------------

    def _take_slot(
        self, body: dict[str, Any], isolated: bool, chat: bool, resumed: bool = False
    ) -> tuple[int, bool]:
        """A slot for ``body`` (set as its ``id_slot``), with its disk-tier state restored;
        returns (slot, cache-isolated). A salted request (cache isolation) reuses no state
        and leaves none behind: no prompt cache, no slot reuse, no disk tier, and its slot
        is wiped when it is given back."""
        pool = self._slot_pool
        assert pool is not None
        slot = pool.acquire("" if isolated else _slot_key(body), resumed=resumed)
        body["id_slot"] = slot
        if isolated:
            body["cache_prompt"] = False
        with self._lock:
            self._active += 1
        try:
            if not isolated:  # a resumed stream restores its own saved state next
                op = "chat" if chat else "completion"
                pool.prepare(slot, op, _template_body(body), lookup=not resumed)
        except BaseException:
            self._give_slot(slot, isolated)
            raise
        return slot, isolated

    def _give_slot(self, slot: int, isolated: bool) -> None:
        pool = self._slot_pool
        assert pool is not None
        if isolated:
            pool.erase(slot)
        pool.release(slot)
        with self._lock:
            self._active -= 1
            self._served += 1

    def _give_timings(self, timings: dict[str, Any]) -> None:
        """The engine's prefill speed teaches the restore-vs-recompute cost model."""
        if self._slot_pool is not None:
            self._slot_pool.observe_prefill(timings)

    def _body(self, request: TextRequest) -> tuple[dict[str, Any], bool]:
        """llama.cpp's request for ``request`` (validated and clamped by the server:
        nothing is checked again here); True when tool calls are emulated."""
        body: dict[str, Any] = {
            "max_tokens": request.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            # An event per prompt batch: a reader that leaves (a client gone, the hard
            # pressure abort) is noticed between batches of a long prefill, not after it.
            "return_progress": True,
            "cache_prompt": True,
        }
        for key, value in (
            ("temperature", request.temperature),
            ("top_p", request.top_p),
            ("seed", request.seed),
            ("presence_penalty", request.presence_penalty),
            ("frequency_penalty", request.frequency_penalty),
            ("logit_bias", request.logit_bias),
            ("response_format", request.response_format),
            ("parallel_tool_calls", request.parallel_tool_calls),
        ):
            if value is not None:
                body[key] = value
        if request.samplers:
            body.update(request.samplers)  # top_k, min_p, mirostat...: llama.cpp's own names
        if request.stop:
            body["stop"] = list(request.stop)
        if request.kind == "completion":
            body["prompt"] = request.prompt
            if request.logprobs is not None:
                body["n_probs"] = request.logprobs  # alternatives per token
            return constrain(body), False
        if request.logprobs is not None:
            body.update(logprobs=True, top_logprobs=request.logprobs)
        # Costly tool schemas are emulated even where the template knows tools: llama.cpp
        # compiles a template's tool grammar as GBNF, where they could hold the engine's loop
        # (engines/llama_grammar.py); emulated, their call schema goes as llguidance.
        native = self._chat_template and self._native_tools and not costly_tools(request.tools)
        tools = {"tools": list(request.tools), "tool_choice": request.tool_choice}
        tool_plan = plan_tools({**body, **tools, "messages": list(request.messages)}, native)
        body, emulated = tool_plan.body, tool_plan.emulated
        if not self._chat_template:
            # No chat template: a plain transcript through the completion endpoint.
            body["prompt"] = _fallback_prompt(body.pop("messages"))
            body["stop"] = [*body.get("stop", []), *FALLBACK_STOPS]
            if "response_format" in body:
                body["json_schema"] = _schema_of(body.pop("response_format"))
            # The completion endpoint takes chat's logprobs as n_probs (alternatives).
            top = body.pop("top_logprobs", None)
            if body.pop("logprobs", None):
                body["n_probs"] = top
        return constrain(body), emulated


def _check_has_tensors(spec: ModelSpec) -> None:
    """A GGUF that lists no tensors holds no weights: llama.cpp fails on it with nothing on
    stderr ("no reason given", a 500 for every request). Say so (422); the load failure
    counts toward the crash backoff. The first file of a split model may hold no tensors."""
    if spec.gguf is None or re.search(r"-\d{5}-of-\d{5}\.gguf$", spec.path.name, re.I):
        return
    # From discovery's read of the header: reading it again here left ~17 MiB of parsed
    # header in the runner's heap.
    if spec.gguf.tensor_bytes is None:
        raise Unprocessable(
            f"the model file {spec.path.name} lists no tensors: it holds no weights, and "
            "llama.cpp cannot load it",
            code="model_has_no_tensors",
        )


class _CapturedStderr:
    """Copies what the engine writes to fd 2 while loading (its only account of *why* a
    load failed) into a temp file, and passes it on to the real stderr afterwards: the
    lines ``shown`` keeps (the engine logs at a verbosity that writes its prompt-cache
    lines, engines/llama_log.py; what the runner's log level would not have shown is left
    out, of the failure's text too)."""

    def __init__(self, shown: Callable[[bytes], bool]) -> None:
        self._shown = shown

    def __enter__(self) -> _CapturedStderr:
        import tempfile

        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc: object) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        lines = self._file.read().splitlines(keepends=True)
        self._file.close()
        self._data = b"".join(ln for ln in lines if self._shown(ln.rstrip(b"\n")))
        os.write(2, self._data)

    def text(self) -> str:
        return self._data.decode("utf-8", "replace")


def _load_error(model: str, log_text: str, n_ctx: int, slots: int, kv: str) -> ElbowroomError:
    """A failed load: out of memory (507 with the fix) or a model the engine cannot read."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    reasons = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
    detail = "; ".join(reasons[-3:]) or (lines[-1] if lines else "no reason given")
    if any(w in log_text.lower() for w in ("alloc", "out of memory", "cannot allocate")):
        return InsufficientMemory(
            f"llama.cpp could not allocate {model} with n_ctx={n_ctx} x {slots} slots, "
            f"kv_type={kv} ({detail}). Try a smaller --ctx, fewer --slots or --kv-type q8_0.",
            code="engine_load_failed",
        )
    return EngineError(f"llama.cpp could not load {model}: {detail}")


def resumable(request: TextRequest) -> bool:
    """Whether a relayed stream may be preempted and resumed as a continuation
    (server/stream/resume.py): a plain streamed text answer. Never a cache-isolated request (its
    slot shares nothing), one resumed already (it must finish), nor tools or a
    response_format (the continuation would restart the grammar mid-object)."""
    return (
        request.stream
        and not request.isolated
        and not request.resumed
        and not request.tools
        and request.response_format in (None, {"type": "text"})
        and request.logprobs is None
    )


def _slot_key(body: dict[str, Any]) -> str:
    """The request's text in order, to keep a conversation on the slot that holds it."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return str(body.get("prompt", messages))
    return "\n".join(
        f"{m.get('role')}: {m.get('content')}" if isinstance(m, dict) else str(m) for m in messages
    )


def _template_body(body: dict[str, Any]) -> dict[str, Any]:
    """What /apply-template needs to render the prompt the engine will see."""
    keep = ("messages", "tools", "tool_choice", "prompt")
    return {k: v for k, v in body.items() if k in keep}


def _schema_of(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") == "json_schema":
        return dict((fmt.get("json_schema") or {}).get("schema") or {})
    return {"type": "object"} if fmt.get("type") == "json_object" else {}


def _fallback_prompt(messages: list[dict[str, Any]]) -> str:
    """A plain transcript for models without a chat template:
    ``User: hi\\nAssistant: hello\\nUser: ...\\nAssistant:``."""
    lines = []
    for m in messages:
        role = str(m.get("role", "user"))
        content = m.get("content") or ""
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        lines.append(f"{FALLBACK_ROLES.get(role, role.capitalize())}: {content}")
    return "\n".join([*lines, "Assistant:"])


def translate_error(err: dict[str, Any]) -> ElbowroomError:
    """The engine's error object -> elbowroom's error tree (one place)."""
    code = int(err.get("code") or 500)
    message = str(err.get("message") or "the engine failed")
    kind = str(err.get("type") or "")
    if kind == "exceed_context_size_error":
        n_prompt, n_ctx = err.get("n_prompt_tokens"), err.get("n_ctx")
        return ContextOverflow(
            f"prompt is {n_prompt} tokens; the context is {n_ctx} tokens per slot and needs at "
            "least 1 free for the reply. Shorten the prompt or load the model with a larger "
            "--ctx.",
            details={"prompt_tokens": n_prompt, "n_ctx": n_ctx},
        )
    if code in (400, 404, 501):
        return BadRequest(f"the engine refused the request: {message}")
    if code == 503:
        return Unavailable(f"the engine is busy: {message}", retry_after=1.0)
    return EngineError(f"llama.cpp failed: {message}")

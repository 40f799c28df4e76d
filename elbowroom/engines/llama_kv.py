"""The KV prefix cache (elbowroom/kvcache) wired to one llama-cpp-python context.

LlamaEngine calls this from its two seams: ``prepare`` before a prompt (restore a cached
prefix when that beats what the context holds and beats recomputing), ``finished`` after
a request (copy the sequence state out as a cache entry). States move with
``llama_state_seq_get_data`` / ``llama_state_seq_set_data`` on sequence 0; trimming a
restored state to the shared prefix reuses the engine's own ``trim`` (which knows about
sliding-window caches), so ``Llama.n_tokens`` / ``input_ids`` always agree with the context.

The RAM tier's grant follows the runner's pressure level (normal: ``kv_ram_max``, soft: a
quarter, hard: nothing), checked at each request and by a small watcher thread, so an idle
runner under pressure also spills its RAM tier to disk.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from elbowroom.kvcache import CacheKey, Hit, PrefixCache, budget_for_level
from elbowroom.kvcache.fileformat import Blob
from elbowroom.models.spec import ModelSpec

log = logging.getLogger(__name__)

WATCH_INTERVAL = 0.5  # seconds between two looks at the pressure level while idle
DEFAULT_RAM_MAX = 512 * 1024**2
DEFAULT_DISK_MAX = 4 * 1024**3
DEFAULT_BLOCK = 64


class LlamaKV:
    def __init__(
        self,
        llm: Any,
        cache: PrefixCache,
        trim: Callable[[int], bool],
        pressure: Callable[[], int],
        ram_max: int,
    ) -> None:
        self._llm = llm
        self.cache = cache
        self._trim = trim
        self._pressure = pressure
        self._ram_max = ram_max
        self._budget = ram_max
        self._budget_lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="kv-budget", daemon=True)
        self._watcher.start()

    @classmethod
    def from_options(
        cls,
        spec: ModelSpec,
        options: dict[str, Any],
        llm: Any,
        *,
        kv_type: str,
        flash_attn: bool,
        n_swa: int,
        trim: Callable[[int], bool],
        pressure: Callable[[], int],
    ) -> LlamaKV | None:
        """The cache the options ask for, or None when ``kv_cache`` is off.

        Without ``kv_cache_dir`` there is no disk tier (the server always passes one).
        """
        if not options.get("kv_cache", True):
            return None
        import llama_cpp

        key = CacheKey(
            model=spec.identity,
            n_ctx=int(llm.n_ctx()),
            kv_type=kv_type,
            # The state layout depends on the library and on flash attention (V transposed
            # or not); a state must never be loaded into a context laid out differently.
            engine=f"llama-cpp-python {llama_cpp.__version__} fa={int(flash_attn)} swa={n_swa}",
        )
        ram_max = int(options.get("kv_ram_max", DEFAULT_RAM_MAX))
        directory = options.get("kv_cache_dir")
        cache = PrefixCache(
            key,
            block_tokens=int(options.get("kv_block_tokens") or DEFAULT_BLOCK),
            ram_budget=ram_max,
            disk_dir=Path(directory).expanduser() if directory else None,
            disk_max=int(options.get("kv_disk_max", DEFAULT_DISK_MAX)),
            window=n_swa,
        )
        return cls(llm, cache, trim, pressure, ram_max)

    # ---- seams ---------------------------------------------------------------------------

    def prepare(self, tokens: Sequence[int], live: int) -> int:
        """How many leading ``tokens`` the context should keep: ``live`` (what it already
        holds) or more after a restore. Returns 0 when a failed restore cleared it."""
        self.sync_budget()
        hit = self.cache.lookup(tokens, live)
        if hit is None:
            return live
        if self.cache.restore(hit, lambda state: self._apply(state, hit, tokens)):
            return hit.n_tokens
        return 0

    def finished(self, tokens: Sequence[int]) -> None:
        """Copy the state of the tokens the context holds into the cache."""
        self.sync_budget()
        if not self.cache.wants(tokens):
            return
        from llama_cpp import llama_cpp as lib

        ctx = self._llm.ctx
        size = int(lib.llama_state_seq_get_size(ctx, 0))
        if size <= 0:
            return
        # Read straight into the buffer the cache keeps: no second copy of the state.
        buf = bytearray(size)
        written = int(
            lib.llama_state_seq_get_data(ctx, (ctypes.c_uint8 * size).from_buffer(buf), size, 0)
        )
        if written <= 0:
            log.warning("llama_state_seq_get_data copied nothing; entry not cached")
            return
        if written < size:
            del buf[written:]
        self.cache.store(tokens, buf)

    def observe_prefill(self, n_tokens: int, seconds: float) -> None:
        self.cache.observe_prefill(n_tokens, seconds)

    def _apply(self, state: Blob, hit: Hit, tokens: Sequence[int]) -> bool:
        """Load ``state`` into sequence 0 and keep ``hit.n_tokens`` of it."""
        from llama_cpp import llama_cpp as lib

        llm = self._llm
        mem = lib.llama_get_memory(llm.ctx)
        lib.llama_memory_seq_rm(mem, 0, -1, -1)
        llm.n_tokens = 0
        size = len(state)
        if isinstance(state, bytearray):
            src: Any = (ctypes.c_uint8 * size).from_buffer(state)
        else:  # bytes are immutable: point at them instead of copying
            src = ctypes.cast(ctypes.c_char_p(state), ctypes.POINTER(ctypes.c_uint8))
        if int(lib.llama_state_seq_set_data(llm.ctx, src, size, 0)) != size:
            log.warning("llama_state_seq_set_data refused a cached state; recomputing")
            lib.llama_memory_seq_rm(mem, 0, -1, -1)
            return False
        n = hit.n_tokens
        llm.input_ids[:n] = tokens[:n]
        if not self._trim(n):
            lib.llama_memory_seq_rm(mem, 0, -1, -1)
            llm.n_tokens = 0
            return False
        return True

    # ---- budget, stats, close ------------------------------------------------------------

    def sync_budget(self) -> None:
        budget = budget_for_level(int(self._pressure()), self._ram_max)
        with self._budget_lock:  # the request thread and the watcher both call this
            if budget != self._budget:
                self._budget = budget
                self.cache.set_ram_budget(budget)

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL):
            try:
                self.sync_budget()
            except Exception:  # never let the watcher die silently on a disk error
                log.exception("KV cache budget update failed")

    def stats(self) -> dict[str, Any]:
        return self.cache.stats()

    def close(self) -> None:
        """Stop watching and flush the RAM tier to disk (graceful unload)."""
        self._stop.set()
        self._watcher.join(timeout=5)
        self.cache.close()

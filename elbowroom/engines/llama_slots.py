"""Which slot serves a request, and the KV prefix cache's disk tier on the engine's slots.

Tiers: the engine's own RAM prompt cache (``cache_ram_mib``, elbowroom's grant) keeps
recent prompt states in memory and restores them into any slot by itself. What it cannot
do is outlive the process: an unloaded, evicted or restarted model starts cold. So when a
runner stops, every slot's state is saved (the engine's slot save) into the disk tier of
``kvcache.PrefixCache`` — elbowroom's file format, model identity, checksum, atomic
writes, byte cap — and a later request whose prompt shares a prefix with a saved state has
it restored into its slot first (slot restore), if the cost model says restoring is
cheaper than recomputing those tokens. The engine then reuses the common token prefix.

Slots are assigned here, not by the engine: each request takes a free slot, preferring the
slot whose last request shares the longest prefix with this one, so a conversation keeps
its slot. The runner runs at most ``slots`` requests at once, so a slot is normally free;
a request that finds none free waits for one (chaos seed 2 once got HTTP 500s from an
empty free set, when idle slots were held for saves under pressure, no longer done).
"""

from __future__ import annotations

import enum
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elbowroom.engines.llama_control import EngineControl
from elbowroom.engines.options import LlamaOptions
from elbowroom.errors import Unavailable
from elbowroom.kvcache import CacheKey, PrefixCache
from elbowroom.kvcache.blocks import common_prefix
from elbowroom.kvcache.cache import Hit

log = logging.getLogger(__name__)

SEQ_MAGIC = 0x67677371  # llama.cpp's LLAMA_STATE_SEQ_MAGIC ("ggsq")
_HEAD = struct.Struct("<II")  # magic, version
MAX_KEY_CHARS = 4096  # of a request's text kept to pick slots by prefix
# A shared beginning shorter than this (a role name, a greeting) does not make a slot "the
# conversation's": the least recently used slot is taken instead, so no live state is
# overwritten for nothing.
MIN_SHARED_CHARS = 64
# A request waits at most this long for a slot held by a save (one slot's state to disk):
# past it the runner is stuck, and the request gets a 503 that says so.
SLOT_WAIT_S = 60.0
# A busy slot whose prompt shares at least this much more with a request than every free
# slot does is worth waiting for (see ``Slots.acquire``): ~256 tokens.
MIN_WAIT_CHARS = 1024
CHARS_PER_TOKEN = 3  # shared characters to tokens to recompute (a generous estimate)
# Prefill speed assumed until the engine has reported one (tokens/s); a slow guess only
# waits longer for a slot that then saves that long prefill.
DEFAULT_PREFILL_TPS = 200.0
MAX_PREFIX_WAIT_S = 120.0
# Preempting (``Slots.preempt``): a busy slot is preempted only when recomputing what it
# holds beyond the free slots would take at least this long; the request then waits at most
# PREEMPT_WAIT_S for the preempted stream's relay to close (then it recomputes).
MIN_PREEMPT_S = 1.0
PREEMPT_WAIT_S = 30.0
# A busy slot not yet past its prefill is asked again this often (each ask reads the
# engine's /slots, which wakes its threads: not much more often than this).
HOLDER_POLL_S = 0.25


class Holder(enum.Enum):
    """What the engine says of a busy slot that holds a waiting request's prefix."""

    PREEMPTED = "preempted"  # its stream is being ended: the slot comes free, claimed
    # Not past its prefill (opening, restoring or computing its prompt, which begins with
    # the waiting request's prefix): it will hold that prefix before a recompute beside it
    # would, since it started first and the two would share the cores. Asked again.
    PREFILLING = "prefilling"
    KEPT = "kept"  # generating, and not preempted (not asked to, or not resumable)


def is_slot_state(blob: bytes) -> bool:
    """Whether ``blob`` starts like an engine slot file (anything else is never stored)."""
    return len(blob) >= _HEAD.size and _HEAD.unpack_from(blob)[0] == SEQ_MAGIC


def _text_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True, slots=True)
class _Tokenized:
    """A prompt as the engine rendered it, and its tokens; ``exact``: from a whole
    tokenization (not stitched from a saved prefix's tokens and the rest's)."""

    text: str = ""
    tokens: tuple[int, ...] = ()
    exact: bool = False


class Slots:
    def __init__(
        self,
        control: EngineControl,
        slots: int,
        cache: PrefixCache | None,
        save_dir: Path,
        block_tokens: int,
    ) -> None:
        self._control = control
        self._cache = cache
        self._save_dir = save_dir
        self.block_tokens = max(1, block_tokens)
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        self._free = set(range(slots))  # slots no request is running on (or being saved)
        self.waiting = 0  # requests waiting for a slot that a save holds
        self._last_key = dict.fromkeys(range(slots), "")
        self._last_len = dict.fromkeys(range(slots), 0)  # of the whole key, before the cut
        self._last_used = dict.fromkeys(range(slots), 0.0)
        self._prefill_tps = 0.0  # the engine's measured prefill speed (tokens/s), 0: unknown
        self.prefix_waits = 0  # requests that waited for the busy slot holding their prefix
        # Asked, without the lock, about a busy slot that holds a waiting request's long
        # prefix, with whether to preempt it (preempt and resume, docs/kvcache.md#preempt:
        # its generation is ended, its stream resumes on another slot, the slot comes
        # free); None: busy slots are waited for up to the recompute estimate, blind.
        self.holder: Callable[[int, bool], Holder] | None = None
        self.may_preempt = False  # kv_preempt
        self.preemptions = 0
        self._taken = dict.fromkeys(range(slots), 0)  # times each slot was acquired
        self._claimed: dict[int, int] = {}  # slot -> the waiting request it was freed for
        self._claims = 0
        # Each slot's last prompt, rendered and tokenized (when the disk tier was looked
        # up for it): the next request of a conversation extends it, and only the new part
        # needs the tokenizer; a save reuses it when it was tokenized whole.
        self._known: dict[int, _Tokenized] = dict.fromkeys(range(slots), _Tokenized())
        # The last prompt each slot served (op, template body): what a saved state is
        # indexed by. The engine's file holds the tokens too, in a layout that is not API.
        self._prompts: dict[int, tuple[str, dict[str, Any]]] = {}
        self.restored_tokens = 0

    @staticmethod
    def create(control: EngineControl, slots: int, key: CacheKey, options: LlamaOptions) -> Slots:
        save_dir = control.dir / "slots"
        save_dir.mkdir(mode=0o700)
        block = options.kv_block_tokens
        cache = None
        if options.kv_cache and options.kv_disk_max > 0 and options.kv_cache_dir:
            # ram_budget 0: the engine's prompt cache is the RAM tier; entries go to disk.
            cache = PrefixCache(
                key,
                block_tokens=block,
                ram_budget=0,
                disk_dir=Path(options.kv_cache_dir),
                disk_max=options.kv_disk_max,
            )
        return Slots(control, slots, cache, save_dir, block)

    @property
    def save_path(self) -> str:
        return str(self._save_dir) + os.sep  # the engine joins path + filename as strings

    # ---- slot assignment ---------------------------------------------------------------

    def acquire(self, key: str, *, resumed: bool = False) -> int:
        """A slot for a request whose text (in order) is ``key``: the free slot that shares
        the longest beginning with it, else the least recently used.

        When a *busy* slot holds a much longer shared beginning than any free slot, the
        request waits for that slot — at most as long as recomputing the difference would
        take — instead of prefilling it again elsewhere. The engine's prompt cache only
        keeps idle slots' prompts, so a prompt whose stream is still running (a client
        that read one token and dropped the stream without closing it: the server sees a
        live connection until the client's garbage collector closes it, and the short
        answer runs to its end) exists nowhere else; a close that reaches the runner a
        moment after the next request is the same race. On a machine whose cores the
        prefills share, running the two prefills side by side would not have been faster.

        While that slot is still prefilling (its prompt begins with this one's prefix) the
        wait goes on past that estimate: it will hold the prefix before a recompute beside
        it would, and on a machine whose cores the prefills share, the recompute would slow
        it down too (the arena's four requests for one model's system prompt each
        recomputed it side by side after ~10 s of waiting). The engine is asked every
        HOLDER_POLL_S (``holder``); the wait ends at MAX_PREFIX_WAIT_S in any case.

        With ``may_preempt`` set, such a slot's generation is ended as soon as it is past its
        prefill, when that saves at least MIN_PREEMPT_S of recompute: its stream resumes on
        another slot (server/stream/resume.py), and the slot is claimed for this request,
        so the resumed one cannot take it back. ``resumed``: that resumed stream itself: it
        takes the best free slot at once (never waits, never preempts).
        """
        whole = len(key)
        key = key[:MAX_KEY_CHARS]

        def score(s: int) -> tuple[int, float]:
            last = self._last_key[s]
            shared = self._shared(s, key, whole)
            # A slot counts when it shares a real beginning, or this request continues
            # (or repeats) everything the slot last held.
            useful = shared > 0 and shared >= min(MIN_SHARED_CHARS, len(last))
            return (shared if useful else 0, -self._last_used[s])

        with self._lock:
            if not self._free:
                self.waiting += 1
                try:
                    if not self._slot_freed.wait_for(lambda: self._free, SLOT_WAIT_S):
                        raise Unavailable(
                            f"no LLM slot came free within {SLOT_WAIT_S:.0f} s (a slot save "
                            "under memory pressure is stuck); retry later",
                            retry_after=5.0,
                        )
                finally:
                    self.waiting -= 1
            deadline: float | None = None
            waited_from = 0.0
            next_ask = 0.0  # when to ask the engine about the busy slot again
            self._claims += 1
            me = self._claims
            tried_preempt = said_prefilling = False
            while True:
                claimed = [s for s, owner in self._claimed.items() if owner == me]
                if claimed and claimed[0] in self._free:
                    slot = claimed[0]  # freed by the preemption for this request: no more
                    break  # comparing (its stream's continuation holds the same prefix)
                slot = max(self._open_slots(me), key=score)
                gain, busy = self._busy_gain(key, whole, score(slot)[0])
                if gain <= 0 or resumed:
                    break
                now = time.monotonic()
                if deadline is None:
                    waited_from = now
                    deadline = now + self._recompute_seconds(gain)
                    self.prefix_waits += 1
                    log.info(
                        "a busy slot holds %d more characters of this prompt than any free "
                        "one: waiting up to %.1f s for it",
                        gain,
                        deadline - now,
                    )
                holder = self.holder
                if holder is not None and now >= next_ask:
                    worth = (
                        self.may_preempt
                        and not tried_preempt
                        and self._recompute_seconds(gain) >= MIN_PREEMPT_S
                    )
                    if worth and not said_prefilling:
                        log.info("preempt: asking for slot %d", busy)
                    self._lock.release()
                    try:
                        answer = holder(busy, worth)
                    finally:
                        self._lock.acquire()
                    next_ask = now + HOLDER_POLL_S
                    if answer is Holder.PREEMPTED:
                        tried_preempt = True
                        next_ask = float("inf")
                        self.preemptions += 1
                        self._claimed[busy] = me
                        deadline = max(deadline, now + PREEMPT_WAIT_S)
                        log.info("preempted the stream on slot %d for this prompt's prefix", busy)
                        continue
                    if answer is Holder.PREFILLING:
                        if not said_prefilling:
                            said_prefilling = True
                            log.info(
                                "slot %d is still computing this prompt's prefix: waiting "
                                "for it rather than computing it beside it",
                                busy,
                            )
                        deadline = max(
                            deadline,
                            min(
                                waited_from + MAX_PREFIX_WAIT_S,
                                now + HOLDER_POLL_S + self._recompute_seconds(gain),
                            ),
                        )
                    else:  # generating: its answer's end is all there is to wait for
                        tried_preempt = tried_preempt or worth
                        next_ask = float("inf")
                if now >= deadline:
                    log.info("the slot holding this prompt's prefix stayed busy: recomputing")
                    break
                wake = deadline if holder is None else min(deadline, next_ask)
                self._slot_freed.wait(wake - now)
            for s, owner in list(self._claimed.items()):
                if owner == me:
                    del self._claimed[s]
            if tried_preempt:
                log.info("preempt: the waiting request takes slot %d", slot)
            self._free.discard(slot)
            self._taken[slot] += 1
            self._last_key[slot] = key
            self._last_len[slot] = whole
            self._last_used[slot] = time.monotonic()
            return slot

    def _open_slots(self, me: int) -> set[int]:
        """The free slots this request may take: not one freed (preempted) for another."""
        mine = {s for s in self._free if self._claimed.get(s, me) == me}
        return mine or self._free

    def _busy_gain(self, key: str, whole: int, free_shared: int) -> tuple[int, int]:
        """Characters a busy slot shares with ``key`` beyond the best free slot's ``free_
        shared``, when that is worth waiting for (else 0), and that slot. Called with the
        lock held."""
        best, best_slot = 0, -1
        for s, last in self._last_key.items():
            if s in self._free or not last:
                continue
            shared = self._shared(s, key, whole)
            if shared > best:
                best, best_slot = shared, s
        gain = best - free_shared
        return (gain, best_slot) if gain >= MIN_WAIT_CHARS else (0, -1)

    def _shared(self, s: int, key: str, whole: int) -> int:
        """Characters slot ``s``'s last request shares with ``key`` (cut at MAX_KEY_CHARS,
        of ``whole``); past the cut, as long as the shorter of the two. Free and busy slots
        are measured alike: a free slot holding the same long prefix as a busy one must not
        look shorter (it did: the busy one was waited for, or preempted, for nothing)."""
        shared = _text_prefix(self._last_key[s], key)
        if shared >= MAX_KEY_CHARS - 1:  # both go on past the cut: as long as the shorter
            shared = min(whole, self._last_len[s])
        return shared

    def _recompute_seconds(self, chars: int) -> float:
        tps = self._prefill_tps or DEFAULT_PREFILL_TPS
        return min(MAX_PREFIX_WAIT_S, chars / CHARS_PER_TOKEN / tps)

    def taken(self, slot: int) -> tuple[int, bool]:
        """How many times ``slot`` was acquired, and whether it is free now."""
        with self._lock:
            return self._taken[slot], slot in self._free

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.add(slot)
            # all: a request waiting for this slot's prefix, and one waiting for any slot
            self._slot_freed.notify_all()

    def erase(self, slot: int) -> None:
        """Wipe ``slot``'s KV state (a cache-isolated request ran on it) and forget what it
        served, so nothing of it is reused, moved to the prompt cache or saved to disk."""
        with self._lock:
            self._last_key[slot] = ""
            self._last_len[slot] = 0
            self._known[slot] = _Tokenized()
            self._prompts.pop(slot, None)
        try:
            self._control.request("POST", f"/slots/{slot}?action=erase", {})
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("could not erase slot %d after an isolated request: %s", slot, exc)

    # ---- a preempted stream's state (server/stream/resume.py) ----------------------------------

    def save_state(self, slot: int, name: str) -> bool:
        """``slot``'s state into the private slot folder as ``name`` (the engine's slot save
        waits until the slot's cancelled generation has stopped)."""
        started = time.perf_counter()
        try:
            self._control.request("POST", f"/slots/{slot}?action=save", {"filename": name})
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("could not save preempted slot %d: %s", slot, exc)
            return False
        log.info("saved preempted slot %d in %.0f ms", slot, (time.perf_counter() - started) * 1e3)
        return True

    def restore_state(self, slot: int, name: str) -> bool:
        """A state ``save_state`` wrote into ``slot``; the file goes either way."""
        path = self._save_dir / name
        started = time.perf_counter()
        try:
            if not path.exists():
                return False
            self._control.request("POST", f"/slots/{slot}?action=restore", {"filename": name})
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("could not restore a preempted state into slot %d: %s", slot, exc)
            return False
        finally:
            path.unlink(missing_ok=True)
        log.info(
            "restored a preempted state into slot %d in %.0f ms",
            slot,
            (time.perf_counter() - started) * 1e3,
        )
        return True

    # ---- disk tier ---------------------------------------------------------------------

    def prepare(self, slot: int, op: str, body: dict[str, Any], *, lookup: bool = True) -> int:
        """Restore a saved state into ``slot`` when it holds a longer usable prefix of this
        prompt than the slot does; return the tokens restored (0: none). ``lookup`` False:
        only note the slot's new prompt (a preempted stream's continuation brings its own
        state: a disk-tier lookup would tokenize its prompt for nothing)."""
        cache = self._cache
        if cache is None:
            return 0
        self._prompts[slot] = (op, body)
        before, self._known[slot] = self._known[slot], _Tokenized()  # until this one's known
        if not lookup or cache.stats()["entries_disk"] == 0:
            return 0  # unknown until tokenized: nothing to compare yet
        started = time.perf_counter()
        try:
            known = self._lookup_tokens(before, op, body)
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("KV disk tier: could not tokenize the prompt: %s", exc)
            return 0
        hit = cache.lookup(known.tokens, common_prefix(before.tokens, known.tokens))
        self._known[slot] = known
        if hit is None:
            return 0
        tokenized = time.perf_counter()
        if not self._restore(slot, hit):
            return 0
        self.restored_tokens += hit.n_tokens
        log.info(
            "KV disk tier: restored %d tokens (%.1f MiB) into slot %d in %.0f ms "
            "(+%.0f ms to tokenize the prompt)",
            hit.n_tokens,
            hit.nbytes / (1 << 20),
            slot,
            (time.perf_counter() - tokenized) * 1000,
            (tokenized - started) * 1000,
        )
        return int(hit.n_tokens)

    def observe_prefill(self, timings: dict[str, Any]) -> None:
        """The engine's measured prefill speed teaches the restore-vs-recompute model, and
        how long a request may wait for the busy slot that holds its prefix."""
        n, ms = timings.get("prompt_n", 0), timings.get("prompt_ms", 0)
        if n >= 64 and ms > 0:  # a few tokens' prefill says little about a long one's
            tps = n / (ms / 1000)
            self._prefill_tps = (
                tps if not self._prefill_tps else 0.7 * self._prefill_tps + 0.3 * tps
            )
        if self._cache is not None and timings.get("prompt_n", 0) > 0:
            self._cache.observe_prefill(int(timings["prompt_n"]), timings["prompt_ms"] / 1000)

    def _lookup_tokens(self, before: _Tokenized, op: str, body: dict[str, Any]) -> _Tokenized:
        """The prompt as the engine renders it and its tokens, for the disk-tier lookup.
        A conversation's next request repeats what its slot last served (``before``), or a
        prompt saved in the disk tier, and adds to it: then only the added text is
        tokenized (here a 7,600-token conversation takes 28 ms to tokenize whole, its next
        turn a millisecond or two; a swapped-out model's prompt, back in a new runner,
        none). At the seam the split can differ from a whole tokenization by a token; that
        only shortens the prefix this lookup sees, never what is reused: the engine
        compares its own tokens."""
        assert self._cache is not None
        rendered = self._render(op, body)
        base = _Tokenized()
        if before.text and before.tokens and rendered.startswith(before.text):
            base = before
        saved, saved_tokens = self._cache.known_text(rendered)
        if len(saved) > len(base.text):
            base = _Tokenized(saved, saved_tokens, exact=True)  # saved whole (``_save``)
        if not base.text:
            return _Tokenized(rendered, self._tokenize(rendered, first=True), exact=True)
        rest = rendered[len(base.text) :]
        if not rest:
            return _Tokenized(rendered, base.tokens, base.exact)
        return _Tokenized(rendered, base.tokens + self._tokenize(rest, first=False))

    def _prompt_text_tokens(
        self, slot: int, op: str, body: dict[str, Any]
    ) -> tuple[str, tuple[int, ...]]:
        """The slot's last prompt, rendered, and its tokens as a whole tokenization makes
        them: what a saved state is indexed by. Those its lookup made are reused when they
        were whole (a long conversation's 28 ms, again, on the way out of a runner)."""
        known = self._known[slot]
        if known.exact and known.text:
            return known.text, known.tokens
        rendered = self._render(op, body)
        return rendered, self._tokenize(rendered, first=True)

    def _render(self, op: str, body: dict[str, Any]) -> str:
        if op == "chat" and "messages" in body:
            return str(self._control.request("POST", "/apply-template", body)["prompt"])
        return str(body.get("prompt", ""))

    def _tokenize(self, text: str, *, first: bool) -> tuple[int, ...]:
        """``text``'s tokens; ``first``: it starts the prompt (the model's BOS is added)."""
        out = self._control.request(
            "POST", "/tokenize", {"content": text, "add_special": first, "parse_special": True}
        )
        return tuple(int(t) for t in out["tokens"])

    def _restore(self, slot: int, hit: Hit) -> bool:
        """The hit's state into ``slot``: put at a path in the engine's private slot
        directory (a disk entry is linked there, not copied), then the engine's restore."""
        assert self._cache is not None
        name = f"restore-{slot}.bin"
        path = self._save_dir / name

        def apply() -> bool:
            try:
                self._control.request("POST", f"/slots/{slot}?action=restore", {"filename": name})
            except (OSError, RuntimeError, ValueError) as exc:
                log.warning("KV disk tier: restoring into slot %d failed: %s", slot, exc)
                return False
            return True

        try:
            return self._cache.restore_file(hit, path, apply)
        except OSError as exc:
            log.warning("KV disk tier: cannot put a state at %s: %s", path, exc)
            return False
        finally:
            path.unlink(missing_ok=True)

    def save_all(self) -> int:
        """Before the runner exits: every slot's state into the disk tier. Returns the
        number of entries written."""
        return self._save(sorted(self._prompts))

    def _save(self, slots: list[int]) -> int:
        if self._cache is None:
            return 0
        written = 0
        started = time.perf_counter()
        for slot in slots:
            if slot not in self._prompts:
                continue
            op, body = self._prompts[slot]
            name = f"save-{slot}.bin"
            path = self._save_dir / name
            try:
                text, tokens = self._prompt_text_tokens(slot, op, body)
                if not self._cache.wants(tokens):
                    continue  # too short, or a saved state already covers it
                self._control.request("POST", f"/slots/{slot}?action=save", {"filename": name})
                blob = path.read_bytes()
            except (OSError, RuntimeError, ValueError) as exc:
                log.debug("slot %d not saved: %s", slot, exc)
                continue
            finally:
                path.unlink(missing_ok=True)
            if is_slot_state(blob) and self._cache.store(tokens, blob, text):
                written += 1
        self._cache.flush()
        if written:
            log.info(
                "KV disk tier: saved %d slot state(s) in %.0f ms",
                written,
                (time.perf_counter() - started) * 1000,
            )
        return written

    def stats(self) -> dict[str, Any]:
        return self._cache.stats() if self._cache is not None else {}

"""The engine's prompt-cache counts read from its log (engines/llama_log.py): the lines as
xllamacpp's llama.cpp writes them at verbosity 4, which lines reach the real stderr, and
the fd-2 reader in a real child process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from bundled_models import bundled_spec

from elbowroom.engines.llama_log import PromptCacheLog, Shown

# A slot taken by another conversation, then the first one back (SmolLM2, one slot).
ENGINE_LOG = b"""\
0.10.524.120 I slot get_availabl: id  0 | task -1 | selected slot by id (0)
0.10.524.176 I srv  get_availabl: updating prompt cache
0.10.524.221 I srv   prompt_save:  - saving prompt with length 215, total state size = 4.727 MiB (draft: 0.000 MiB)
0.10.528.643 I srv          load:  - looking for better prompt, base f_keep = 0.023, f_sim = 0.139
0.10.528.711 I srv          load:    - prompt with length     215, lcp =       5, f_keep = 0.023, f_sim = 0.139
0.10.528.735 I srv        update:  - cache state: 1 prompts, 4.727 MiB (limits: 64.000 MiB, 1024 tokens, 2910 est)
0.10.528.753 I srv        update:    - prompt 0x7f3504553340:     215 tokens, checkpoints:  0,     4.727 MiB
0.11.783.489 I srv  get_availabl: updating prompt cache
0.11.783.519 I srv   prompt_save:  - saving prompt with length 41, total state size = 0.902 MiB (draft: 0.000 MiB)
0.11.784.180 I srv          load:    - prompt with length     215, lcp =     201, f_keep = 0.935, f_sim = 0.957
0.11.784.210 I srv          load:  - found better prompt with f_keep = 0.935, f_sim = 0.957
0.11.785.164 I srv        update:  - cache state: 1 prompts, 0.902 MiB (limits: 64.000 MiB, 1024 tokens, 2908 est)
0.11.785.420 I slot   operator(): id  0 | task 14 | cached n_tokens = 201, memory_seq_rm [201, end)
"""  # noqa: E501


def test_lookups_hits_and_the_last_cache_state() -> None:
    counts = PromptCacheLog()
    for line in ENGINE_LOG.splitlines():
        counts.feed(line)
    assert counts.stats() == {
        "entries_ram": 1,
        "bytes_ram": round(0.902 * 2**20),
        "hits_ram": 1,
        "misses_ram": 1,
        "lookups_ram": 2,
    }
    assert counts.limit == 64 * 2**20
    counts.reset()
    assert counts.stats()["lookups_ram"] == 0 and counts.stats()["bytes_ram"] == 0


def test_engine_info_and_warning_lines_are_hidden_unless_debug() -> None:
    lines = [
        b"0.10.524.176 I srv  get_availabl: updating prompt cache",
        b"\trepeat_last_n = 64, repeat_penalty = 1.000",  # continues the line above
        b"0.10.524.177 W srv  load_model: a warning",
        b"0.10.524.178 E srv  load_model: an error",
        b"2026-11-27 23:50:00,000 runner[m:1] INFO the runner's own log",
        b"Traceback (most recent call last):",
    ]
    live = Shown(verbose=False)
    assert [live(ln) for ln in lines] == [False, False, False, True, True, True]
    # Live, a line without the engine's prefix after a hidden one may be anyone's.
    live = Shown(verbose=False)
    assert [live(lines[0]), live(b"Traceback (most recent call last):")] == [False, True]
    # The chat template's example at load: quoted over several lines, hidden whole; a
    # line of ggml's own (no prefix) after an engine info line is shown.
    load = Shown(verbose=False)
    example = [
        b"0.06.353.473 I srv          init: init: chat template, example_format: '<|im_start|>",
        b"Hello<|im_end|>",
        b"'",
        b"ggml_aligned_malloc: insufficient memory (attempted to allocate 9000.00 MB)",
    ]
    assert [load(ln) for ln in example] == [False, False, False, True]
    debug = Shown(verbose=True)
    assert all(debug(ln) for ln in lines)


def test_the_tap_counts_fd2_and_passes_on_what_is_shown() -> None:
    """A real child process: its fd 2 goes through the reader; what C code and Python write
    there arrives on the real stderr (the engine's info lines left out) and is counted."""
    lines = ENGINE_LOG.decode().splitlines()
    script = textwrap.dedent(
        f"""
        import json, os, sys
        from elbowroom.engines import llama_log
        counts = llama_log.tap(verbose=False)
        for line in {lines!r}:
            os.write(2, (line + "\\n").encode())  # as C code writes: straight to fd 2
        print("python's own stderr line", file=sys.stderr, flush=True)
        os.write(2, b"0.11.790.000 E srv  update_slots: an engine error\\n")
        llama_log._TAP.close()  # drains the pipe: every line above is read
        print(json.dumps(counts.stats()))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert '"hits_ram": 1' in done.stdout and '"entries_ram": 1' in done.stdout
    assert done.stderr.splitlines() == [
        "python's own stderr line",
        "0.11.790.000 E srv  update_slots: an engine error",
    ]


def test_a_runner_whose_load_fails_says_why(tmp_path: Path) -> None:
    """A real engine in a child process, as a runner loads it (prompt_cache_log): a
    truncated GGUF fails in llama.cpp, and its error lines reach the load's error (at
    verbosity 0 the engine wrote nothing: "no reason given")."""
    spec = bundled_spec("smollm2-135m")
    truncated = tmp_path / "truncated.gguf"
    data = spec.path.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    script = textwrap.dedent(
        f"""
        import dataclasses, pathlib, sys
        sys.path[:0] = ["tests"]
        from bundled_models import bundled_spec
        from elbowroom.engines.llama import LlamaEngine
        from elbowroom.engines.options import LlamaOptions
        from elbowroom.errors import EngineError
        path = pathlib.Path({str(truncated)!r})
        spec = dataclasses.replace(bundled_spec("smollm2-135m"), path=path)
        options = LlamaOptions(n_ctx=256, cache_ram_bytes=8 << 20, prompt_cache_log=True)
        try:
            LlamaEngine(lambda: 0).load(spec, options)
        except EngineError as err:
            print(err)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "failed to load model" in done.stdout and "no reason given" not in done.stdout
    assert " I " not in done.stderr  # the engine's info lines stayed out of the log

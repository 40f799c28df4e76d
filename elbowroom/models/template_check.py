"""The load-time chat template check: render a GGUF's chat template in a bounded subprocess.

A GGUF's ``tokenizer.chat_template`` is code (Jinja) that llama.cpp runs while it loads the
model and on every chat request. A crafted one hurts the host: ``range(1000000000)`` spun a
loading runner up to 23.6 GB; a macro that calls itself crashed the runner (SIGSEGV) on
every load. Before the engine loads a GGUF, this module renders each of its chat templates
(read here with elbowroom's own GGUF reader, models.gguf_meta) with a sample conversation in
a short-lived child process (``python -m elbowroom.models.template_check``, the templates on
its stdin) under jinja2's ImmutableSandboxedEnvironment, with
RLIMIT_AS/RLIMIT_DATA (``chat_template_check_memory``) and RLIMIT_CPU
(``chat_template_check_seconds``). A template that runs out of time or memory, recurses
past Python's limit, asks the sandbox for a range too big, or crashes the child is
*unsafe*: the load is refused (422 ``chat_template_unsafe``) without starting a runner.

llama.cpp renders templates with its own engine (minja), not jinja2: the check catches
templates that are unbounded in jinja2 too (loops, recursion, string blow-ups), not every
difference between the two. An ordinary template error (``raise_exception``, an undefined
name) is not a verdict: the engine has its own answer for those.

The verdict is kept per file (path, size, mtime): a normal model pays the check once per
server process (a Python start and one render: 0.1-0.5 s for SmolLM2 on a busy 2-core
machine, 0.13 of its load; benchmarks/results/template_check.md).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from elbowroom.errors import Unprocessable

log = logging.getLogger(__name__)

EXIT_OK, EXIT_UNSAFE, EXIT_MEMORY = 0, 2, 3


@dataclass(frozen=True, slots=True)
class Verdict:
    safe: bool
    reason: str = ""
    seconds: float = 0.0


class TemplateUnsafe(Unprocessable):
    def __init__(self, message: str) -> None:
        super().__init__(message, code="chat_template_unsafe")


class TemplateChecker:
    """Runs the check once per file version and remembers the verdict."""

    def __init__(self, seconds: float, memory: int) -> None:
        self.seconds = seconds
        self.memory = memory
        self._verdicts: dict[tuple[str, int, int], Verdict] = {}
        self._lock = threading.Lock()
        self._file_locks: dict[tuple[str, int, int], threading.Lock] = {}
        self.runs = 0  # subprocesses started (tests: the verdict is cached)

    def check(self, path: Path, model_id: str) -> None:
        """Raise TemplateUnsafe when ``path``'s chat template is unsafe (blocking: call it
        in a thread)."""
        try:
            st = path.stat()
        except OSError:
            return  # the load itself will say what is wrong with the file
        key = (str(path), st.st_size, st.st_mtime_ns)
        with self._lock:  # one check per file at a time; other files do not wait for it
            file_lock = self._file_locks.setdefault(key, threading.Lock())
        with file_lock:
            verdict = self._verdicts.get(key)
            if verdict is None:
                verdict = self._run(path)
                self._verdicts[key] = verdict
        if not verdict.safe:
            raise TemplateUnsafe(
                f"model {model_id!r} was not loaded: the chat template in {path.name} "
                f"{verdict.reason}. A crafted template can take the host's memory or crash "
                "the engine while it loads. Fix the file, or turn the check off for files you "
                "trust (chat_template_check = false, ELBOWROOM_CHAT_TEMPLATE_CHECK=0)"
            )

    def _run(self, path: Path) -> Verdict:
        import time

        from elbowroom.models.gguf_meta import InvalidModel, read_chat_templates

        try:
            templates = read_chat_templates(path)
        except (OSError, InvalidModel) as exc:
            log.warning("chat template of %s unreadable: %s", path.name, exc)
            return Verdict(True)  # the load says what is wrong with the file
        if not templates:
            return Verdict(True)
        self.runs += 1
        started = time.monotonic()
        # Wall time: the CPU limit ends the child; this only catches one that sleeps or waits
        # for a CPU on a busy host (Python's start counts too).
        wall = 10.0 + 4 * self.seconds
        cmd = [
            sys.executable,
            "-m",
            "elbowroom.models.template_check",
            str(self.seconds),
            str(self.memory),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
        try:
            done = subprocess.run(
                cmd,
                input=json.dumps(templates).encode(),
                capture_output=True,
                timeout=wall,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return Verdict(False, f"did not finish rendering in {wall:.0f} s", wall)
        took = time.monotonic() - started
        code = done.returncode
        if code == EXIT_OK:
            log.info("chat template of %s checked in %.2f s", path.name, took)
            return Verdict(True, seconds=took)
        if code == EXIT_UNSAFE:
            reason = _reason(done.stdout).rstrip(".") or "failed to render"
            return Verdict(False, reason, took)
        if code == EXIT_MEMORY:
            return Verdict(
                False, f"needed more than {self.memory >> 20} MiB to render a short chat", took
            )
        if code in (-signal.SIGXCPU, -signal.SIGKILL):
            return Verdict(
                False,
                f"used more than {self.seconds:g} s of CPU rendering a short chat "
                "(chat_template_check_seconds)",
                took,
            )
        if code < 0:
            name = signal.Signals(-code).name
            return Verdict(False, f"crashed the renderer ({name}) on a short chat", took)
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        return Verdict(False, f"failed to render (exit {code}: {' '.join(tail)})", took)


def _reason(stdout: bytes) -> str:
    try:
        return str(json.loads(stdout.decode("utf-8", "replace").strip() or "{}").get("reason", ""))
    except ValueError:
        return ""


# ---------------------------------------------------------------------------- the child

SAMPLE_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 is 4."},
    {"role": "user", "content": "And 3 + 3?"},
]
SAMPLE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _limit(seconds: float, memory: int) -> None:
    import resource

    # CPU seconds this process has used so far (its start and imports) do not count.
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(used.ru_utime + used.ru_stime + max(1.0, seconds) + 0.999)
    # Soft: SIGXCPU; hard one second later: SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    # ``memory`` on top of what the interpreter and its imports hold already.
    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
    now = {k: int(v) * 1024 for k, v in re.findall(r"^(VmSize|VmData):\s+(\d+) kB", status, re.M)}
    resource.setrlimit(resource.RLIMIT_AS, (now.get("VmSize", 0) + memory,) * 2)
    resource.setrlimit(resource.RLIMIT_DATA, (now.get("VmData", 0) + memory,) * 2)


def _render(template: str) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise _TemplateRaised(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    for tools in (None, SAMPLE_TOOLS):
        compiled.render(
            messages=SAMPLE_MESSAGES,
            tools=tools,
            add_generation_prompt=True,
            bos_token="<s>",
            eos_token="</s>",
        )


class _TemplateRaised(Exception):
    """The template's own ``raise_exception``: an ordinary refusal, not a verdict."""


def _child(argv: list[str]) -> int:
    """The templates (key -> text, JSON on stdin; read by the parent with gguf_meta), rendered
    under the bounds ``argv`` gives (CPU seconds, bytes)."""
    seconds, memory = float(argv[0]), int(argv[1])
    templates: dict[str, str] = json.loads(sys.stdin.buffer.read())
    import jinja2  # before the limits: its import is not the template's cost
    from jinja2.exceptions import SecurityError

    _limit(seconds, memory)
    for key, template in templates.items():
        try:
            _render(template)
        except MemoryError:
            os._exit(EXIT_MEMORY)  # printing may need memory the limit no longer gives
        except RecursionError:
            print(json.dumps({"reason": f"({key}) recurses without end (a macro calling itself)"}))
            return EXIT_UNSAFE
        except (SecurityError, OverflowError) as exc:
            print(json.dumps({"reason": f"({key}) hit a sandbox limit: {exc}"}))
            return EXIT_UNSAFE
        except (_TemplateRaised, jinja2.TemplateError, TypeError, ValueError, LookupError):
            continue  # an ordinary template error: the engine answers those itself
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))

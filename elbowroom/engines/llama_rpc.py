"""The engine of a model split over nodes: llama.cpp's ``llama-server`` with RPC devices.

The PyPI xllamacpp wheel has no RPC backend (its ``CommonParams`` has no RPC servers), so a
split model runs in an RPC-enabled ``llama-server`` built from the same llama.cpp revision
(``scripts/rpc_engine.sh``). Everything else is ``LlamaEngine``: the same request bodies,
stream parsing, tools, slots and KV tiers. Only the engine object differs: instead of the
in-process ``xllamacpp.Server`` it is a llama-server child process listening on the
runner's private Unix socket (the one xllamacpp would have opened, same key), with the
nodes' ``rpc-server`` endpoints as devices, every layer offloaded and ``--tensor-split``
giving each device its whole layers (``cluster.split``).

Options (from the cluster router): ``rpc_servers`` ["host:port", ...] in device order,
``rpc_split`` the matching layer counts, ``llama_server`` the binary (default: the cached
build of ``scripts/rpc_engine.sh``). No RPC servers: the same build unsplit on this CPU,
the reference a split's output is compared with (the PyPI wheel's kernels can round
differently, so greedy text may differ from ``LlamaEngine``'s after a few tokens).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from elbowroom.engines.base import Cancelled, Emit, PressureLevel
from elbowroom.engines.llama import LlamaEngine
from elbowroom.engines.llama_control import _UnixConnection
from elbowroom.engines.options import (
    EngineOptions,
    Offload,
    RpcLlamaOptions,
    expect,
    tensor_split_arg,
)
from elbowroom.engines.requests import Payload
from elbowroom.errors import EngineError, RunnerCrashed
from elbowroom.models.spec import ModelSpec
from elbowroom.rpc_bind import check_rpc_bind

XLLAMACPP_VERSION = "2026.10.11549"
READY_TIMEOUT = 300.0
STREAM_TIMEOUT = 600.0


def rpc_build_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elbowroom" / f"llama-rpc-{XLLAMACPP_VERSION}"


def default_binary(name: str) -> Path:
    """``llama-server`` or ``rpc-server`` of the cached RPC build."""
    return rpc_build_dir() / name


_KV = {0: "f32", 1: "f16", 8: "q8_0", 2: "q4_0"}  # ggml_type values the engine uses
_FA = {-1: "auto", 0: "off", 1: "on"}


def server_args(params: Any, binary: Path, rpc: list[str], split: list[int]) -> list[str]:
    """llama-server's command line for xllamacpp ``params`` (what LlamaEngine.load set),
    with ``rpc`` devices and every layer offloaded by ``split``."""
    for endpoint in rpc:
        check_rpc_bind(endpoint.rsplit(":", 1)[0].strip("[]"))
    args = [
        str(binary),
        "-m", str(params.model.path),
        "-c", str(params.n_ctx),
        "--parallel", str(params.n_parallel),
        "--kv-unified" if params.kv_unified else "--no-kv-unified",
        "-b", str(params.n_batch),
        "-ub", str(params.n_ubatch),
        "--cache-type-k", _KV[int(params.cache_type_k)],
        "--cache-type-v", _KV[int(params.cache_type_v)],
        "-fa", _FA[int(params.flash_attn_type)],
        "--cache-ram", str(params.cache_ram_mib),
        "--ctx-checkpoints", str(params.n_ctx_checkpoints),
        "--context-shift" if params.ctx_shift else "--no-context-shift",
        "--fit", "off",
        "--host", params.hostnames[0],
        "--api-key", params.api_keys[0],
    ]  # fmt: skip
    if rpc:
        args += ["--rpc", ",".join(rpc), "--tensor-split", tensor_split_arg(split), "-ngl", "999"]
    else:  # no devices: the same build unsplit, on this CPU (the reference in tests)
        args += ["-ngl", "0"]
    if params.slot_save_path:
        args += ["--slot-save-path", params.slot_save_path]
    if params.endpoint_metrics:
        args.append("--metrics")
    if params.cpuparams.n_threads > 0:
        args += ["-t", str(params.cpuparams.n_threads)]
    if params.verbosity >= 3:
        args.append("-v")
    return args


class StreamCut(RuntimeError):
    """llama-server's answer ended without its end marker: the split lost a device (an RPC
    server or its node went away) or llama-server itself died."""


class LlamaServerProcess:
    """Duck-types ``xllamacpp.Server``'s two request calls over llama-server's HTTP API on
    the private Unix socket: each SSE ``data:`` object goes to the callback; a callback that
    returns True ends the request (closing the connection cancels it in llama-server)."""

    def __init__(self, args: list[str], socket_path: str, key: str, log_path: Path) -> None:
        self._socket = socket_path
        self._key = key
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.close()
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{tail}")
            try:
                status, _ = self._get("/health")
            except OSError:
                status = 0
            if status == 200:
                return
            time.sleep(0.1)  # polling a child's readiness: no event to wait on
        self.close()
        raise RuntimeError(f"llama-server was not ready within {READY_TIMEOUT:g} s")

    def _get(self, path: str) -> tuple[int, bytes]:
        conn = _UnixConnection(self._socket, 5.0)
        try:
            conn.request("GET", path, headers={"Authorization": f"Bearer {self._key}"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def handle_chat_completions(self, text: str, callback: Callable[[str], bool]) -> None:
        self._stream("/v1/chat/completions", text, callback)

    def handle_completions(self, text: str, callback: Callable[[str], bool]) -> None:
        self._stream("/v1/completions", text, callback)

    def _stream(self, path: str, text: str, callback: Callable[[str], bool]) -> None:
        conn = _UnixConnection(self._socket, STREAM_TIMEOUT)
        try:
            conn.request(
                "POST",
                path,
                body=text.encode(),
                headers={
                    "Authorization": f"Bearer {self._key}",
                    "Content-Type": "application/json",
                },
            )
            resp = conn.getresponse()
            if resp.status != 200:
                raw = resp.read().decode(errors="replace")
                if resp.status == 400 and '"error"' not in raw:
                    raise ValueError(raw)
                callback(raw if raw.startswith("{") else json.dumps({"error": {"message": raw}}))
                return
            try:
                for line in resp:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        return
                    if callback(data.decode()):
                        return
            except (OSError, http.client.HTTPException) as exc:
                raise StreamCut(f"the connection to llama-server broke ({exc})") from exc
            code = self.proc.poll()
            raise StreamCut(
                "llama-server ended the answer early"
                + (f" and exited with {code}" if code is not None else "")
            )
        finally:
            conn.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def __del__(self) -> None:  # LlamaEngine.close drops its reference to the engine
        with contextlib.suppress(Exception):
            self.close()


class RpcLlamaEngine(LlamaEngine):
    def __init__(self, pressure: PressureLevel = lambda: 0) -> None:
        super().__init__(pressure)
        self._rpc: list[str] = []
        self._split: list[int] = []
        self._binary = default_binary("llama-server")
        self.log_path: Path | None = None

    def load(self, spec: ModelSpec, options: EngineOptions) -> dict[str, Any]:
        opts = expect(options, RpcLlamaOptions, "llama-rpc")
        self._rpc = list(opts.rpc_servers)
        self._split = list(opts.rpc_split)
        if len(self._rpc) != len(self._split):
            raise EngineError("a split model needs one rpc_split count per rpc_servers entry")
        self._binary = Path(opts.llama_server or default_binary("llama-server"))
        if not self._binary.is_file():
            raise EngineError(
                f"no RPC-enabled llama-server at {self._binary}: run scripts/rpc_engine.sh "
                "(docs/cluster.md)"
            )
        # Every layer goes to the devices: the RPC servers (in rpc_split's proportions).
        facts = super().load(spec, replace(opts, offload=Offload(n_gpu_layers=999)))
        return {**facts, "engine": "llama-server (RPC)", "rpc_servers": self._rpc,
                "rpc_split": self._split}  # fmt: skip

    def run(self, op: str, payload: Payload, emit: Emit, cancelled: Cancelled) -> dict[str, Any]:
        try:
            return super().run(op, payload, emit, cancelled)
        except EngineError as err:
            if not isinstance(err.__cause__, StreamCut):
                raise
            # Not the request's fault: the split is losing a part. A 503 the client may
            # retry; the router takes the split down and plans it again.
            raise RunnerCrashed(
                f"the split model's engine lost a device: {err.__cause__}; the request failed, "
                "the next one places the model again",
                code="runner_crashed",
                details={"exit_cause": str(err.__cause__)},
            ) from None

    def _drop(self, server: Any, process_exit: bool) -> None:
        # The engine is a llama-server child: it is stopped, whether or not this process
        # exits next (an orphan would keep the model's memory).
        if server is not None:
            server.close()

    def _read_log(self, params: Any) -> None:
        return None  # llama-server writes its log to its own file (log_path), unread

    def _start_server(self, params: Any) -> Any:
        args = server_args(params, self._binary, self._rpc, self._split)
        self.log_path = Path(params.hostnames[0]).with_name("llama-server.log")
        return LlamaServerProcess(args, params.hostnames[0], params.api_keys[0], self.log_path)

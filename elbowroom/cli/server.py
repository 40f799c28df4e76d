"""`elbowroom serve`, and `ps` / `load` / `unload`, which talk to a running server over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elbowroom.cli.common import add_common, print_json, settings_from, table
from elbowroom.config import KV_TYPES, Settings
from elbowroom.errors import ElbowroomError
from elbowroom.server.deps import parse_keep_alive
from elbowroom.units import format_size

DEFAULT_URL = "http://127.0.0.1:8000"


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI API (and the admin API under /api)")
    add_common(p)
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000; 0 picks one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument(
        "--admin-key", default=None, help="a separate key for /api, /metrics (docs/security.md)"
    )
    p.add_argument("--preload", action="append", metavar="ID", help="load at start (repeat)")
    p.add_argument("--pin", action="append", metavar="ID", help="load at start, never evict")
    p.add_argument("--ctx", type=int, default=None, help="LLM context per slot (default: auto)")
    p.add_argument("--slots", type=int, default=None, help="parallel sequences per LLM (4)")
    p.add_argument(
        "--model-slots", action="append", metavar="ID=N", help="slots of one model (repeat)"
    )
    p.add_argument("--kv-type", default=None, choices=KV_TYPES)
    p.add_argument("--keep-alive", default=None, help='idle LLM unload after, e.g. 300 or "5m"')
    p.add_argument("--models-dir", type=Path, default=None, help="folder of model files")
    p.add_argument("--model", action="append", type=Path, metavar="PATH", help="serve this file")
    p.add_argument(
        "--no-memory-guard",
        dest="memory_guard",
        action="store_const",
        const=False,
        default=None,
        help="do not react to memory pressure (the monitor still samples)",
    )
    p.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"))
    p.add_argument(
        "--cluster",
        "--ray-address",
        dest="cluster",
        default=None,
        metavar="ADDRESS",
        help="serve over a Ray cluster: auto or HOST:6379 (run on a cluster machine), or "
        "ray://HOST:10001 (Ray Client, from any machine); docs/cluster.md",
    )
    p.set_defaults(func=cmd_serve)

    for name, helptext, func in (
        ("ps", "list the running server's models, runners and memory", cmd_ps),
        ("load", "load a model on the running server", cmd_load),
        ("unload", "unload a model on the running server", cmd_unload),
    ):
        q = sub.add_parser(name, help=helptext)
        q.add_argument("--json", action="store_true", help="print JSON for machines")
        q.add_argument("--url", default=os.environ.get("ELBOWROOM_URL", DEFAULT_URL))
        # The client commands use admin routes: the admin key when there is one.
        q.add_argument(
            "--api-key",
            default=os.environ.get("ELBOWROOM_ADMIN_KEY") or os.environ.get("ELBOWROOM_API_KEY"),
        )
        if name != "ps":
            q.add_argument("model", help="model id (see elbowroom ls)")
        else:
            q.add_argument(
                "--watch",
                action="store_true",
                help="redraw every second: memory pools, models, recent events (Ctrl-C ends)",
            )
            q.add_argument(
                "--interval", type=float, default=1.0, help="seconds between redraws (1)"
            )
            q.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)
        if name == "load":
            pin = q.add_mutually_exclusive_group()
            pin.add_argument(
                "--pin",
                dest="pin",
                action="store_const",
                const=True,
                help="pin it: never evicted, never expires",
            )
            pin.add_argument(
                "--unpin",
                dest="pin",
                action="store_const",
                const=False,
                help="unpin it (it is evicted and expires like the others)",
            )
        q.set_defaults(func=func)


# --- serve


def cmd_serve(args: argparse.Namespace) -> int:
    keep_alive = None
    if args.keep_alive is not None:
        try:
            keep_alive = parse_keep_alive(args.keep_alive)
        except ElbowroomError as exc:
            print(f"elbowroom: --keep-alive: {exc.message}", file=sys.stderr)
            return 2
    settings = settings_from(
        args,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        admin_key=args.admin_key,
        preload=args.preload,
        pin=args.pin,
        ctx=args.ctx,
        slots=args.slots,
        model_slots=args.model_slots,
        kv_type=args.kv_type,
        keep_alive=keep_alive,
        models_dir=args.models_dir,
        model_paths=args.model,
        log_level=args.log_level,
        memory_guard=args.memory_guard,
        cluster=args.cluster,
    )
    from elbowroom.server.http.auth import check_exposure

    any_key = bool(settings.api_key or settings.api_keys or settings.admin_key)
    refusal = check_exposure(settings.host, any_key)
    if refusal is not None:
        print(f"elbowroom: {refusal}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        sock = _bind(settings.host, settings.port)
    except OSError as exc:
        print(
            f"elbowroom: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr
        )
        return 1
    try:
        with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
            return runner.run(_serve(settings, sock, as_json=args.json))
    except KeyboardInterrupt:
        return 130
    except asyncio.CancelledError:  # SIGTERM while starting
        return 143
    except ElbowroomError as exc:
        print(f"elbowroom: cannot start: {exc.message}", file=sys.stderr)
        return 1
    finally:
        sock.close()


def _bind(host: str, port: int) -> socket.socket:
    """Bind before loading anything: a busy port fails in a second, not after a model load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)  # runner processes must not hold the listening socket
    return sock


async def _serve(settings: Settings, sock: socket.socket, *, as_json: bool) -> int:
    import uvicorn

    from elbowroom.server.app import create_app, start_services, stop_services

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    # SIGINT already cancels us during startup (asyncio.run); make SIGTERM do the same.
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    # Runners are spawned with this process's environment: they must not get the keys.
    for name in ("ELBOWROOM_API_KEY", "ELBOWROOM_API_KEYS", "ELBOWROOM_ADMIN_KEY"):
        os.environ.pop(name, None)
    try:
        services = await start_services(settings)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)

    # From here uvicorn owns SIGINT/SIGTERM (graceful: finish responses, then return) and
    # re-raises the signal when it returns; make that re-raise harmless so that the
    # runners are always stopped below instead of the process dying first.
    previous = {s: signal.signal(s, _ignore) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        from elbowroom.server.http.connections import protocol_class

        app = create_app(settings, services=services)
        config = uvicorn.Config(
            app,
            http=protocol_class(settings),  # header_timeout, max_connections
            log_level=settings.log_level,
            access_log=settings.log_level == "debug",
            timeout_graceful_shutdown=max(1, round(settings.stop_grace)),
        )
        server = uvicorn.Server(config)
        # What startup built lives as long as the server: out of the collector's sight, a
        # full collection walks only what requests make (it walked it all: 170 ms holding
        # the interpreter lock, /health included, during issue 28's integer-body attack).
        gc.collect()
        gc.freeze()
        _announce(settings, sock, services, as_json)
        await server.serve(sockets=[sock])
    finally:
        await stop_services(services)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop for ``event_loop``: uvloop's (libuv: each wake-up of a streamed token
    costs the server less CPU, which on a machine whose cores all decode is taken from the
    engine's threads) or asyncio's standard one (None)."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ElbowroomError("event_loop is uvloop but uvloop is not installed") from None
        return None
    return uvloop.new_event_loop


def _ignore(signum: int, frame: Any) -> None:
    return None


def _announce(settings: Settings, sock: socket.socket, services: Any, as_json: bool) -> None:
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    report = dict(services.scheduler.memory_report())
    if as_json:
        print(
            json.dumps({"url": url, "openai_base_url": url + "/v1", "memory": report}, default=str),
            flush=True,
        )
        return
    print(f"elbowroom listening on {url} (OpenAI base URL {url}/v1)", flush=True)
    if report.get("cluster"):
        for line in cluster_budget_lines(report):
            print(line, flush=True)
    else:
        print(f"memory: {_budget_line(report)}", flush=True)
    if settings.api_key or settings.api_keys or settings.admin_key:
        admin = " (/api, /metrics: the admin key)" if settings.admin_key else ""
        print(
            f"auth: every route but /health needs 'Authorization: Bearer <key>'{admin}", flush=True
        )


def _budget_line(report: dict[str, Any]) -> str:
    """'limit 15.2 GiB (total 19.2 GiB − OS reserve 4.0 GiB ...), committed 0 B, ...'."""
    limit: dict[str, Any] = report.get("limit") or {}
    winner: dict[str, Any] = next(
        (c for c in limit.get("candidates", []) if c.get("name") == limit.get("winner")), {}
    )
    why = f" ({winner['why']})" if winner.get("why") else ""
    return (
        f"limit {format_size(limit.get('value'))}{why}, "
        f"committed {format_size(report.get('committed'))}, "
        f"pressure {report.get('pressure', '-')}"
    )


def cluster_budget_lines(report: dict[str, Any]) -> list[str]:
    """Over a cluster: the sums over the live nodes, labelled so, then one line per node
    (the per-node numbers the sums are made of)."""
    totals: dict[str, Any] = report.get("totals") or {}
    lines = [
        f"memory, cluster total over {totals.get('nodes', 0)} nodes: "
        f"limit {format_size(totals.get('limit'))}, "
        f"load ceiling {format_size(totals.get('ceiling'))}, "
        f"committed {format_size(totals.get('committed'))}; "
        f"{cluster_pressure_text(report.get('pressure'), report.get('worst_node'))}"
    ]
    for node in report.get("nodes") or ():
        if not node.get("alive"):
            lines.append(f"  node {node.get('name')}: gone")
        elif "limit" in node:
            lines.append(f"  node {node.get('name')}: {_budget_line(node)}")
    return lines


def cluster_pressure_text(level: Any, worst: Any) -> str:
    """The cluster's pressure is its worst node's: say which, unless every node is normal."""
    if level in (None, "normal"):
        return "pressure normal on every node"
    return f"pressure {level} (node {worst}, the worst)"


def node_rows(nodes: list[dict[str, Any]], now: float) -> list[list[Any]]:
    """The node table's rows; a node that left shows as gone, with how long ago."""
    rows = []
    for n in nodes:
        alive = "yes"
        if not n.get("alive"):
            since = n.get("gone_at")
            alive = f"gone {now - float(since):.0f} s ago" if since else "gone"
        rows.append(
            [
                n.get("name"),
                alive,
                n.get("pressure") or "-",
                format_size(n.get("committed")) if n.get("alive") else "-",
                format_size(n.get("available")) if n.get("alive") else "-",
                format_size(n.get("ceiling")) if n.get("alive") else "-",
                ", ".join(n.get("models") or []) or "-",
            ]
        )
    return rows


def memory_footer(memory: dict[str, Any]) -> str:
    """The line under `ps`'s tables, labelled: this machine's numbers, or the cluster's
    sums over its live nodes."""
    pressure = memory.get("pressure")
    ceiling = memory.get("ceiling")
    of = (
        f"the {format_size(ceiling)} load ceiling (limit {format_size(memory.get('limit'))})"
        if ceiling is not None
        else f"the {format_size(memory.get('limit'))} limit"
    )
    if memory.get("scope") == "cluster":
        return (
            f"cluster total over {memory.get('nodes')} nodes: committed "
            f"{format_size(memory.get('committed'))} of {of}, the sums of the nodes above; "
            f"{cluster_pressure_text(pressure, memory.get('worst_node'))}"
        )
    return (
        f"this machine: committed {format_size(memory.get('committed'))} of {of}; "
        f"pressure {pressure}"
    )


# --- client commands


def cmd_ps(args: argparse.Namespace) -> int:
    if args.watch:
        from elbowroom.cli.watch import watch

        return watch(
            lambda: _call(args, "GET", "/api/elbowroom/dashboard"),
            interval=max(0.1, args.interval),
            as_json=args.json,
            count=args.count,
        )
    data = _call(args, "GET", "/api/elbowroom/ps")
    if data is None:
        return 1
    if args.json:
        print_json(data)
        return 0
    rows = [
        [
            m.get("id"),
            m.get("kind"),
            m.get("state"),
            m.get("pid"),
            format_size(m.get("bytes")),
            "yes" if m.get("pinned") else "no",
            m.get("busy", 0),
            m.get("processor") or "-",
            m.get("expires_at") or "never",
        ]
        for m in data.get("models", [])
    ]
    if rows:
        headers = [
            "MODEL", "KIND", "STATE", "PID", "MEMORY", "PINNED", "BUSY", "PROCESSOR", "UNLOADS AT"
        ]  # fmt: skip
        models = data.get("models", [])
        if any("node" in m for m in models):  # over a cluster: where each model runs
            headers.insert(1, "NODE")
            for row, m in zip(rows, models, strict=True):
                row.insert(1, m.get("node", "-"))
        print(table(headers, rows))
    else:
        print("no models loaded")
    if data.get("nodes"):
        print()
        headers = ["NODE", "ALIVE", "PRESSURE", "COMMITTED", "FREE", "CEILING", "MODELS"]
        print(table(headers, node_rows(data["nodes"], time.time())))
    memory = data.get("memory", {})
    if memory.get("limit") is not None:
        print("\n" + memory_footer(memory))
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    body = {} if args.pin is None else {"pin": args.pin}
    data = _call(args, "POST", f"/api/models/{args.model}/load", body)
    if data is None:
        return 1
    if args.json:
        print_json(data)
    else:
        runner = data.get("runner", {})
        extra = f", pid {runner['pid']}" if runner.get("pid") else ""
        pinned = " (pinned)" if data.get("pinned") else ""
        print(f"loaded {data.get('model')}{pinned}{extra}")
    return 0


def cmd_unload(args: argparse.Namespace) -> int:
    data = _call(args, "POST", f"/api/models/{args.model}/unload")
    if data is None:
        return 1
    if args.json:
        print_json(data)
    else:
        print(f"unloaded {data.get('model')}")
    return 0


def _call(
    args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """One JSON request to the server; prints the server's error message and returns None."""
    url = args.url.rstrip("/") + path
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if args.api_key:
        req.add_header("Authorization", f"Bearer {args.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            result: dict[str, Any] = json.loads(resp.read() or b"{}")
            return result
    except urllib.error.HTTPError as exc:
        message = _error_message(exc)
        if args.json:
            print_json({"error": {"status": exc.code, "message": message}})
        print(f"elbowroom: {method} {url}: {exc.code} {message}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        print(
            f"elbowroom: cannot reach the server at {args.url}: {reason} "
            "(is `elbowroom serve` running? set --url)",
            file=sys.stderr,
        )
    return None


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read())
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(exc.reason)

"""PURE: where llama.cpp RPC servers may listen, and the command lines of a split.

llama.cpp's RPC protocol has no authentication and no encryption (CVE-2026-34159: a peer
that reaches the port can read and write the server's memory). An RPC server therefore
binds to loopback or a private interface only; anything else (0.0.0.0, a public address,
a host name) is refused with what to do instead: a private network or an SSH/WireGuard
tunnel (docs/cluster.md).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from pathlib import Path

__all__ = ["RpcBindError", "check_rpc_bind", "llama_server_args", "rpc_server_args"]


class RpcBindError(ValueError):
    pass


def check_rpc_bind(host: str) -> str:
    """``host`` when it is a loopback or private address; else RpcBindError naming the fix."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise RpcBindError(
            f"RPC bind address {host!r} is not an IP address; give the node's loopback or "
            "private address (host names could resolve to a public one)"
        ) from None
    if addr.is_unspecified:
        raise RpcBindError(
            f"refusing to bind a llama.cpp RPC server to {host} (every interface): the RPC "
            "protocol is unauthenticated (CVE-2026-34159); bind to a private address or "
            "127.0.0.1 and tunnel (docs/cluster.md)"
        )
    if not (addr.is_loopback or (addr.is_private and not addr.is_link_local)):
        raise RpcBindError(
            f"refusing to bind a llama.cpp RPC server to public address {host}: the RPC "
            "protocol is unauthenticated (CVE-2026-34159); use a private network or an "
            "SSH/WireGuard tunnel (docs/cluster.md)"
        )
    return host


def rpc_server_args(binary: Path, host: str, port: int, mem_bytes: int | None) -> list[str]:
    """``rpc-server`` on one node: the checked address, and the memory it may serve."""
    args = [str(binary), "--host", check_rpc_bind(host), "--port", str(port)]
    if mem_bytes is not None:
        args += ["--mem", str(max(1, mem_bytes // 1024**2))]  # MiB
    return args


def llama_server_args(
    binary: Path,
    model: Path,
    *,
    rpc: Sequence[tuple[str, int]],
    split: str,
    n_ctx: int,
    port: int,
    threads: int | None = None,
) -> list[str]:
    """The split model's runner: llama-server with the RPC servers as devices, every layer
    offloaded, ``split`` (``tensor_split``) giving each device its layers; it listens on
    loopback only (the head's runner talks to it)."""
    for host, _ in rpc:
        check_rpc_bind(host)
    args = [
        str(binary),
        "-m",
        str(model),
        "--rpc",
        ",".join(f"{h}:{p}" for h, p in rpc),
        "--tensor-split",
        split,
        "-ngl",
        "999",
        "-c",
        str(n_ctx),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if threads is not None:
        args += ["-t", str(threads)]
    return args

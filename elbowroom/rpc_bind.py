"""PURE: where llama.cpp RPC servers may listen.

llama.cpp's RPC protocol has no authentication and no encryption (CVE-2026-34159: a peer
that reaches the port can read and write the server's memory). An RPC server therefore
binds to loopback or a private interface only; anything else (0.0.0.0, a public address,
a host name) is refused with what to do instead: a private network or an SSH/WireGuard
tunnel (docs/cluster.md). A ground-floor module: the settings check ``rpc_host`` with it,
the split engine its peers, the cluster its RPC servers.
"""

from __future__ import annotations

import ipaddress

__all__ = ["RpcBindError", "check_rpc_bind"]


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

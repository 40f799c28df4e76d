"""PURE: the command line of a node's llama.cpp RPC server, on an address that
``rpc_bind.check_rpc_bind`` allows (loopback or private only: docs/cluster.md)."""

from __future__ import annotations

from pathlib import Path

from elbowroom.rpc_bind import check_rpc_bind

__all__ = ["rpc_server_args"]


def rpc_server_args(binary: Path, host: str, port: int, threads: int | None = None) -> list[str]:
    """``rpc-server`` on one node, on the checked address. (This llama.cpp revision's
    rpc-server serves its backend's whole memory: what a split may take there is
    elbowroom's arithmetic, not a flag. The split's llama-server command line is built
    from the engine's own parameters: engines/llama_rpc.py.)"""
    args = [str(binary), "--host", check_rpc_bind(host), "--port", str(port)]
    if threads:
        args += ["-t", str(threads)]
    return args

"""The `elbowroom` command. One module per command group; each exposes ``register(sub)``
which adds its subparsers and sets ``func`` (args -> exit code). Output is for people
(tables); every command also takes ``--json`` for machines."""

from __future__ import annotations

import argparse
import sys

from elbowroom import __version__
from elbowroom.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    from elbowroom.cli import memory as memory_cmd
    from elbowroom.cli import models as models_cmd
    from elbowroom.cli import pull as pull_cmd
    from elbowroom.cli import server as server_cmd

    parser = argparse.ArgumentParser(
        prog="elbowroom",
        description="Local inference server that never lets memory exhaustion crash the machine.",
    )
    parser.add_argument("--version", action="version", version=f"elbowroom {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    memory_cmd.register(sub)
    models_cmd.register(sub)
    pull_cmd.register(sub)
    server_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"elbowroom: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

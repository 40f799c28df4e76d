"""`elbowroom pull NAME` (download a model from the Hugging Face Hub, after a fit check) and
`elbowroom rm MODEL` (delete a pulled model). docs/pull.md has the details."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from elbowroom.cli.common import add_common, print_json, settings_from
from elbowroom.config import Settings
from elbowroom.errors import ElbowroomError
from elbowroom.units import format_size as fs


def register(sub: Any) -> None:
    p = sub.add_parser(
        "pull",
        help="download a model from Hugging Face, after checking it fits this machine",
        description="Download NAME (hf.co/USER/REPO[:QUANT] or USER/REPO[:QUANT]) from the "
        "Hugging Face Hub into the models folder, where `elbowroom serve` finds it. Before "
        "the first byte of weights it reads the GGUF header with HTTP range requests and "
        "predicts the footprint on this machine: a model that can never fit is refused "
        "(exit 1) unless --force. Without a QUANT, the largest quant that fits is picked. "
        "HF_TOKEN opens gated repos; HF_ENDPOINT names a mirror.",
    )
    p.add_argument("name", metavar="NAME", help="hf.co/USER/REPO[:QUANT] or USER/REPO[:QUANT]")
    p.add_argument("--file", default=None, help="pull this file of the repository exactly")
    p.add_argument("--revision", default=None, help="branch, tag or commit (main)")
    p.add_argument("--force", action="store_true", help="download even if it cannot fit")
    p.add_argument(
        "--check", action="store_true", help="only check: choose, fit-check, download nothing"
    )
    p.add_argument("--ctx", type=int, default=None, help="check the fit at this context")
    p.add_argument("--models-dir", type=Path, default=None, help="folder of model files")
    add_common(p)
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser(
        "rm",
        help="delete a model that `elbowroom pull` downloaded",
        description="Delete MODEL (an id from `elbowroom ls`, or the NAME it was pulled by): "
        "its links in the models folder and the downloaded files no other model uses. "
        "Models elbowroom did not download are never deleted.",
    )
    p.add_argument("name", metavar="MODEL", help="a model id, or hf.co/USER/REPO[:QUANT]")
    p.add_argument("--models-dir", type=Path, default=None, help="folder of model files")
    add_common(p)
    p.set_defaults(func=cmd_rm)


def _settings(args: argparse.Namespace, **extra: Any) -> Settings:
    return settings_from(args, models_dir=args.models_dir, **extra)


class _Bar:
    """A progress bar per file (rich), with speed and time left; on stderr."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.tasks: dict[str, Any] = {}
        self.started = False

    def __call__(self, event: dict[str, Any]) -> None:
        status = str(event.get("status", ""))
        if "total" in event and "digest" in event:
            if not self.started:
                self.progress.start()
                self.started = True
            key = status
            if key not in self.tasks:
                name = status.removeprefix("downloading ")
                self.tasks[key] = self.progress.add_task(
                    name, total=event["total"], completed=event.get("completed", 0)
                )
            self.progress.update(self.tasks[key], completed=event.get("completed", 0))
        elif status == "pulling manifest":
            print("pulling manifest", file=sys.stderr)

    def close(self) -> None:
        if self.started:
            self.progress.stop()


def _json_line(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def cmd_pull(args: argparse.Namespace) -> int:
    # The 507 the command prints says it all: the planner's own warning is not repeated. The
    # level is put back afterwards, as the command also runs inside other programs (tests).
    quiet = logging.getLogger("elbowroom.scheduler")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return _pull(args)
    finally:
        quiet.setLevel(level)


def _pull(args: argparse.Namespace) -> int:
    from elbowroom.pull.fit import FITS, with_ctx
    from elbowroom.pull.puller import Puller

    bar: _Bar | None = None
    try:
        settings = with_ctx(_settings(args), args.ctx)
        if args.json:
            progress = _json_line
        else:
            bar = _Bar()
            progress = bar
        puller = Puller(settings, progress=None if args.json and args.check else progress)
        plan = puller.plan(args.name, file=args.file, revision=args.revision, force=args.force)
        if not args.json:
            print(_plan_text(plan), file=sys.stderr)
        if args.check:
            if args.json:
                print_json(plan.to_dict())
            return 0
        result = puller.download(plan)
    except ElbowroomError as exc:
        if bar is not None:
            bar.close()
        return _fail(exc, args.json)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        print("elbowroom: pull interrupted; pull again to resume", file=sys.stderr)
        return 130
    if bar is not None:
        bar.close()
    if args.json:
        _json_line({"status": "done", **result.to_dict()})
        return 0
    served = f"served as {result.model_id!r}" if result.model_id else "not in the catalog?"
    resumed = f", {fs(result.resumed)} resumed" if result.resumed else ""
    print(
        f"pulled {plan.repo_id} ({plan.choice.quant or plan.choice.kind}): "
        f"{fs(result.downloaded)} downloaded{resumed} in {result.seconds:.1f} s; "
        f"{served} from {result.path}"
    )
    if plan.fit is not None and plan.fit.verdict != FITS:
        print(f"note: {plan.fit.message}")
    return 0


def _plan_text(plan: Any) -> str:
    lines = [f"{plan.repo_id} @ {plan.commit[:12]}: {plan.why}"]
    if plan.fit is not None:
        read = (
            f" (read {fs(plan.header_bytes)} of headers in {plan.header_requests} requests)"
            if plan.header_requests
            else ""
        )
        forced = " — downloading anyway (--force)" if plan.forced else ""
        lines.append(f"fit check: {plan.fit.message}{read}{forced}")
    lines.append(
        f"disk: {fs(plan.to_download)} to download, {fs(plan.disk_free)} free; "
        f"installs into {plan.dest}"
    )
    return "\n".join(lines)


def cmd_rm(args: argparse.Namespace) -> int:
    from elbowroom.models.catalog import discover
    from elbowroom.pull.puller import remove_by_name

    try:
        settings = _settings(args)
        removed = remove_by_name(settings, discover(settings), args.name)
    except ElbowroomError as exc:
        return _fail(exc, args.json)
    if args.json:
        print_json(
            {
                "deleted": [
                    {"model": r.model_id, "paths": [str(p) for p in r.paths], "freed": r.freed}
                    for r in removed
                ]
            }
        )
        return 0
    for r in removed:
        print(f"deleted {r.model_id} ({fs(r.freed)} freed)")
    return 0


def _fail(exc: ElbowroomError, as_json: bool) -> int:
    if as_json:
        _json_line({"error": exc.message, "code": exc.code, "status": exc.status, **exc.details})
    read = exc.details.get("header_bytes_read")
    if read:  # a fit-check refusal: what it read to say so
        read_text = f" (the fit check read {fs(int(read))} of GGUF headers; nothing downloaded)"
        print(f"elbowroom: {exc.message}{read_text}", file=sys.stderr)
    else:
        print(f"elbowroom: {exc.message}", file=sys.stderr)
    return 1

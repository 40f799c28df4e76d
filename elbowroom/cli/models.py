"""`elbowroom ls` (the catalog, with predicted footprints) and `elbowroom plan MODEL` (the
budget arithmetic for one model, step by step).

Standalone: no server is asked, so nothing is committed yet ("ours" is 0) and the budget is
the one a server starting now would have. The sizing, the fit and the suggestions are the
server's own (``scheduler.planner``: plan_load, GPU placement, policy.decide and its 507
suggestions), so `plan` and a load cannot disagree. A running server shows its own view at
/api/ps.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from elbowroom.cli.common import add_common, print_json, settings_from, table
from elbowroom.config import KV_TYPES, Settings
from elbowroom.errors import ElbowroomError
from elbowroom.memory.budget import Fit, Limit, fits, limit_to_dict
from elbowroom.memory.monitor import Monitor, Sample
from elbowroom.memory.probe import default_probe
from elbowroom.memory.types import Snapshot
from elbowroom.models import vision
from elbowroom.models.bundled import unprepared
from elbowroom.models.catalog import Catalog, discover
from elbowroom.models.estimate import max_context, swa_layers
from elbowroom.models.measured import MeasuredStore
from elbowroom.models.spec import Footprint, ModelSpec
from elbowroom.scheduler import policy
from elbowroom.scheduler.inputs import default_estimator
from elbowroom.scheduler.planner import budget_state, plan_and_decide
from elbowroom.scheduler.sizing import Plan
from elbowroom.units import format_size as fs


def _add_catalog_flags(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--models-dir", type=Path, default=None, help="folder of model files")
    p.add_argument(
        "--model", action="append", type=Path, metavar="PATH", help="also list this file/folder"
    )
    p.add_argument("--kv-type", default=None, choices=KV_TYPES, help="KV cache type (f16)")
    p.add_argument("--slots", type=int, default=None, help="parallel sequences (1)")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "ls",
        help="list the models, their predicted footprint and whether they fit",
        description="List every model in the catalog: kind, engine, size on disk, the context "
        "an LLM would get, the predicted footprint, and whether it fits the budget now.",
    )
    _add_catalog_flags(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "plan",
        help="show the budget arithmetic for loading one model",
        description="Show step by step how elbowroom sizes MODEL: the budget, the weights, "
        "the KV cache, the overhead, whether it fits and the largest context that does. "
        "Exits 1 when it cannot fit.",
    )
    p.add_argument("model_id", metavar="MODEL", help="a model id from `elbowroom ls`")
    _add_catalog_flags(p)
    p.add_argument("--ctx", type=int, default=None, help="LLM context (default: auto-sized)")
    p.set_defaults(func=cmd_plan)


def _settings(args: argparse.Namespace, **extra: Any) -> Settings:
    paths = tuple(args.model) if args.model else None
    return settings_from(
        args,
        models_dir=args.models_dir,
        model_paths=paths,
        kv_type=args.kv_type,
        slots=args.slots,
        **extra,
    )


_CTX_SOURCES = {"setting": "ctx setting", "min_ctx": "min_ctx (auto: none fits)"}


def _nothing_ours() -> int:
    return 0


class _Context:
    """What both commands read from the world: catalog, the memory sample a server starting
    now would take (nothing ours yet), measurements."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.catalog: Catalog = discover(settings)
        monitor = Monitor.from_settings(
            settings, default_probe(settings), own_usage=_nothing_ours, history_seconds=0
        )
        self.sample: Sample = monitor.read()
        self.snapshot: Snapshot = self.sample.snapshot
        self.limit: Limit = self.sample.limit
        self.measured = MeasuredStore(settings.measurements_path)

    def plan(self, spec: ModelSpec, ctx_flag: bool = False) -> _Verdict:
        """The server's plan for loading ``spec`` with nothing else loaded, its fit against
        the load ceiling, and the policy's refusal (with its suggestions) if any."""
        state = budget_state((), self.limit.ceiling, self.sample.pools, 0)
        plan, decision = plan_and_decide(
            spec,
            self.settings,
            state,
            self.sample.pools,
            default_estimator(),
            self.measured,
            self.limit.value,
        )
        fit = fits(plan.footprint.total, 0, self.limit)
        refusal = decision if isinstance(decision, policy.Refuse) else None
        if refusal is not None and fit.ok:  # a GPU pool that cannot hold its share
            fit = dataclasses.replace(fit, ok=False, reason=refusal.message())
        how = "--ctx" if ctx_flag and plan.ctx_source == "setting" else plan.ctx_source
        return _Verdict(plan, _CTX_SOURCES.get(how, how), fit, refusal)


@dataclasses.dataclass(frozen=True, slots=True)
class _Verdict:
    plan: Plan
    how: str  # where the context came from, for people
    fit: Fit
    refusal: policy.Refuse | None  # the server's 507, when it would refuse the load


def _footprint_dict(fp: Footprint) -> dict[str, Any]:
    return {**asdict(fp), "total": fp.total, "at_load": fp.at_load}


# ------------------------------------------------------------------------------- ls


def _projector_dict(spec: ModelSpec) -> dict[str, Any] | None:
    proj = spec.projector
    if proj is None:
        return None
    return {
        "path": str(proj.path),
        "type": proj.projector_type,
        "image_size": proj.image_size,
        "image_tokens": proj.image_tokens,
        "weight_bytes": proj.weight_bytes,
    }


def cmd_ls(args: argparse.Namespace) -> int:
    try:
        ctx = _Context(_settings(args))
    except (ElbowroomError, OSError) as exc:
        return _fail(exc)
    rows, items = [], []
    for spec in ctx.catalog.list():
        verdict = ctx.plan(spec)
        n_ctx, how, fp, fit = verdict.plan.n_ctx, verdict.how, verdict.plan.footprint, verdict.fit
        gate = vision.gate(
            spec.id, spec.vision, fp.total, ctx.limit.value, ctx.settings.vision_gate
        )
        refused = gate.verdict is vision.Verdict.REFUSE
        rows.append(
            [
                spec.id,
                spec.kind.value + (" +vision" if spec.vision else ""),
                spec.engine,
                fs(spec.size_bytes),
                n_ctx or "-",
                fs(fp.total) + (" (measured)" if fp.measured else ""),
                "no (vision gate)" if refused else "yes" if fit.ok else "no",
                spec.source,
            ]
        )
        items.append(
            {
                "id": spec.id,
                "kind": spec.kind.value,
                "engine": spec.engine,
                "holding": spec.holding.value,
                "path": str(spec.path),
                "size_bytes": spec.size_bytes,
                "source": spec.source,
                "description": spec.description,
                "n_ctx": n_ctx,
                "n_ctx_source": how,
                "footprint": _footprint_dict(fp),
                "fits": fit.ok and not refused,
                "shortfall": fit.shortfall,
                "capabilities": vision.capabilities(spec),
                "projector": _projector_dict(spec),
                "vision_gate": gate.details() if spec.vision else None,
            }
        )
    problems = [{"path": str(p.path), "reason": p.reason} for p in ctx.catalog.problems]
    pending = unprepared(ctx.settings)
    if args.json:
        print_json(
            {
                "limit": limit_to_dict(ctx.limit),
                "models": items,
                "problems": problems,
                "unprepared": pending,
            }
        )
        return 0
    headers = ["ID", "KIND", "ENGINE", "SIZE", "CTX", "FOOTPRINT", "FITS", "SOURCE"]
    print(table(headers, rows) if rows else "no models found")
    print(
        f"\nbudget: load ceiling {fs(ctx.limit.ceiling)} of the {fs(ctx.limit.value)} limit "
        f"({ctx.limit.winner}, {ctx.limit.rule} rule: {ctx.limit.rule_why}); footprint = "
        "anonymous + file-backed, predicted unless marked measured; `elbowroom plan ID` shows "
        "the arithmetic"
    )
    for problem in problems:
        print(f"skipped {problem['path']}: {problem['reason']}")
    for model_id in pending:
        print(f"{model_id} is not prepared yet: python -m elbowroom.models.bundled --prepare")
    return 0


# ------------------------------------------------------------------------------- plan


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        settings = _settings(args, ctx=args.ctx)
        ctx = _Context(settings)
    except (ElbowroomError, OSError) as exc:
        return _fail(exc)
    if args.model_id not in ctx.catalog:
        known = ", ".join(m.id for m in ctx.catalog.list()) or "none"
        print(f"elbowroom: no model {args.model_id!r} (known: {known})", file=sys.stderr)
        return 1
    spec = ctx.catalog.get(args.model_id)
    s = ctx.settings
    verdict = ctx.plan(spec, ctx_flag=args.ctx is not None)
    fit = verdict.fit
    largest = (
        max_context(spec, ctx.limit.ceiling, s.slots_for(spec.id), s.kv_type, None, ctx.measured)
        if spec.gguf or spec.mlx
        else 0
    )
    # The server's 507 suggestions, word for word.
    tips = [t.message for t in verdict.refusal.suggestions] if verdict.refusal else []
    if args.json:
        print_json(_plan_dict(ctx, spec, verdict, largest, tips))
    else:
        print(_plan_text(ctx, spec, verdict, largest, tips))
    if not fit.ok:
        print(f"elbowroom: {spec.id} does not fit: {fit.reason}", file=sys.stderr)
        return 1
    return 0


def _plan_dict(
    ctx: _Context, spec: ModelSpec, verdict: _Verdict, largest: int, tips: list[str]
) -> dict[str, Any]:
    snap, s = ctx.snapshot, ctx.settings
    n_ctx, how, fp, fit = verdict.plan.n_ctx, verdict.how, verdict.plan.footprint, verdict.fit
    return {
        "model": {
            "id": spec.id,
            "kind": spec.kind.value,
            "engine": spec.engine,
            "path": str(spec.path),
            "size_bytes": spec.size_bytes,
            "gguf": {
                k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(spec.gguf).items()
            }
            if spec.gguf
            else None,
            "mlx": asdict(spec.mlx) if spec.mlx else None,
        },
        "memory": {
            "total": snap.total,
            "available": snap.available,
            "host_total": snap.host_total,
            "cgroup_limit": snap.cgroup_limit,
            "override": snap.override,
        },
        "limit": limit_to_dict(ctx.limit),
        "context": {
            "n_ctx": n_ctx,
            "source": how,
            "trained": spec.gguf.trained_ctx
            if spec.gguf
            else (spec.mlx.trained_ctx if spec.mlx else None),
            "max_ctx": s.max_ctx,
            "min_ctx": s.min_ctx,
            "largest_fitting": largest if spec.gguf or spec.mlx else None,
        },
        "footprint": _footprint_dict(fp),
        "vision": _vision_dict(ctx, spec, fp),
        "fit": asdict(fit),
        "prompt_cache_grant": verdict.plan.cache_grant,
        "suggestions": tips,
    }


def _vision_dict(ctx: _Context, spec: ModelSpec, fp: Footprint) -> dict[str, Any] | None:
    if spec.projector is None or spec.gguf is None:
        return None
    cost = vision.extra_footprint(spec.projector, spec.gguf.n_embd)
    gate = vision.gate(spec.id, True, fp.total, ctx.limit.value, ctx.settings.vision_gate)
    return {
        **(_projector_dict(spec) or {}),
        "at_load": cost.at_load,
        "working": cost.working,
        "gate": {**gate.details(), "verdict": gate.verdict.value},
    }


def _plan_text(
    ctx: _Context, spec: ModelSpec, verdict: _Verdict, largest: int, tips: list[str]
) -> str:
    snap, s, limit = ctx.snapshot, ctx.settings, ctx.limit
    n_ctx, how, fp, fit = verdict.plan.n_ctx, verdict.how, verdict.plan.footprint, verdict.fit
    grant = verdict.plan.cache_grant
    lines = [f"plan for {spec.id}: {spec.description or spec.path}", ""]
    memory = f"1. memory total {fs(snap.total)}"
    if snap.total != snap.host_total:
        memory += f" (host {fs(snap.host_total)}; smaller of cgroup limit and override)"
    lines += [
        memory + f", available now {fs(snap.available)}",
        f"   rule: {limit.rule} ({limit.rule_why})",
        "",
        "2. limit candidates:",
    ]
    rows = [
        ["*" if c.name == limit.winner else "", c.name, fs(c.value), c.why]
        for c in limit.candidates
    ]
    lines += ["   " + line for line in table(["", "candidate", "value", "why"], rows).splitlines()]
    lines += [
        f"   limit = {fs(limit.value)} ({limit.winner}); loads are admitted up to the load "
        f"ceiling {fs(limit.ceiling)} (below the soft threshold {fs(limit.soft)}); nothing "
        "committed (no server)",
        "",
    ]
    src = " (measured)" if fp.measured else ""
    if spec.gguf is not None:
        g = spec.gguf
        mapped = g.tensor_bytes or fp.weights
        runtime_file = fp.file_backed - mapped
        heads = f"{g.n_kv_heads} KV heads × ({g.head_dim_k} + {g.head_dim_v}) dims"
        windowed = sum(swa_layers(g))
        window = f"; {windowed} sliding-window layers hold ≤ {g.sliding_window} + 512" * bool(
            windowed
        )
        engine = fp.overhead - fp.working
        lines += [
            f"3. weights (GGUF tensors, mmap'd, file-backed): {fs(mapped)}"
            f" + runtime libraries {fs(runtime_file)} = {fs(fp.file_backed)}{src}",
            f"4. context: {n_ctx} tokens per slot × {fp.slots} slot(s) ({how}; trained"
            f" {g.trained_ctx}, max_ctx {s.max_ctx}, min_ctx {s.min_ctx})",
            f"5. KV cache ({fp.kv_type}): {g.n_layers} layers × {heads} ="
            f" {fs(fp.kv_bytes_per_token)}/token{window}; × {n_ctx} × {fp.slots} slot(s) ="
            f" {fs(fp.kv_bytes)}",
            f"6. engine, vocabulary, logits: {fs(engine)}; repacked weights {fs(fp.repacked)};"
            f" compute buffer {fs(fp.compute)} and per-slot state"
            f" {fs(fp.working - fp.compute)} (what serving touches: {fs(fp.working)})",
            f"   anonymous = KV + repacked + the rest = {fs(fp.anonymous)}{src}",
        ]
        if spec.projector is not None:
            cost = vision.extra_footprint(spec.projector, g.n_embd)
            gate = vision.gate(spec.id, True, fp.total, limit.value, s.vision_gate)
            lines += [
                f"   vision ({spec.projector.projector_type} projector, "
                f"{spec.projector.image_tokens} tokens per image): weights "
                f"{fs(cost.weights)} + encoder runtime {fs(cost.at_load - cost.weights)} (in"
                f" the engine line), encoder working memory {fs(cost.working)} (in what"
                " serving touches); image tokens take context, no extra KV",
                f"   vision gate: {fs(fp.total)} is {gate.share:.0%} of the {fs(limit.value)}"
                f" limit (gate {s.vision_gate:.0%}): "
                + ("REFUSED (507)" if gate.verdict is vision.Verdict.REFUSE else "passes"),
            ]
    elif spec.mlx is not None:
        m = spec.mlx
        lines += [
            f"3. weights (MLX safetensors, {m.quantization}, copied into anonymous memory):"
            f" {fs(fp.weights)} on disk"
            + (
                " (float32 on this CPU: half-precision tensors double)"
                if fp.kv_type == "f32"
                else ""
            ),
            f"4. context: {n_ctx} tokens ({how}; trained {m.trained_ctx}, max_ctx {s.max_ctx},"
            f" min_ctx {s.min_ctx}); one sequence at a time",
            f"5. KV cache ({fp.kv_type}, allocated at load): {m.n_layers} layers × "
            f"{m.n_kv_heads} KV heads × 2 × {m.head_dim} dims = {fs(fp.kv_bytes_per_token)}"
            f"/token; × {n_ctx} = {fs(fp.kv_bytes)}",
            f"6. runtime (mlx, mlx-lm, tokenizer) and compute {fs(fp.compute)}: "
            f"{fs(fp.overhead)}; anonymous = {fs(fp.anonymous)}; libraries (file-backed) "
            f"{fs(fp.file_backed)}{src}",
        ]
    else:
        lines += [
            f"3. weights on disk: {fs(fp.weights)} (loaded into anonymous memory)",
            "4. context: none (not an LLM)",
            "5. KV cache: none",
            f"6. runtime and working memory: {fs(fp.overhead)}; anonymous = {fs(fp.anonymous)};"
            f" libraries (file-backed) {fs(fp.file_backed)}{src}",
        ]
    lines += [
        f"7. predicted total = anonymous {fs(fp.anonymous)} + file-backed {fs(fp.file_backed)}"
        f" = {fs(fp.total)}{src}" + (f" ({fs(fp.at_load)} right after load)" if fp.working else ""),
        f"8. {fit.reason}" if fit.ok else f"8. DOES NOT FIT: {fit.reason}",
    ]
    if spec.gguf is not None or spec.mlx is not None:
        lines.append(
            f"   largest context that fits: {largest}"
            + (f" (auto-sizing stops at max_ctx {s.max_ctx})" if largest > s.max_ctx else "")
            if largest
            else "   largest context that fits: none"
        )
    lines += [f"   try: {tip}" for tip in tips]
    if spec.gguf is not None and fit.ok:
        lines.append(
            f"9. prompt-cache grant: {fs(grant)} (kv_ram_max {fs(s.kv_ram_max)}, at most"
            f" {s.kv_ram_kv_factor:g} x the KV cache {fs(fp.kv_bytes)} (kv_ram_kv_factor),"
            f" shrunk to the {fs(max(0, limit.ceiling - fp.total))} the model leaves under the"
            " ceiling; budgeted beside the model, not part of its footprint)"
        )
    return "\n".join(lines)


def _fail(exc: ElbowroomError | OSError) -> int:
    message = exc.message if isinstance(exc, ElbowroomError) else str(exc)
    print(f"elbowroom: {message}", file=sys.stderr)
    return 1

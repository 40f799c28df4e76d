"""The guard's reaction time: a neighbour crosses the guard's soft point in a real cgroup v1,
with the kernel's notifications (``pressure_events``) against the monitor's ticks alone.

    sudo .venv/bin/python benchmarks/guard_reaction.py [--rounds 10]

Two `elbowroom serve` processes, each in its own 1.5 GiB memory cgroup with SmolLM2 pinned
(a pinned model is not unloaded at soft, so every round starts from the same state; the
first relief action is pausing loads): **events** (the pressure watch on,
``monitor_interval`` 60 s, so only a notification can answer in time) and **ticks** (the
watch off, ``monitor_interval`` 1 s, the default). The trend (``pressure_horizon``) is off
in both: what is timed is the answer to a crossing, not a projection. Each round, in each
server in turn (interleaved), a neighbour process in its cgroup grows to 32 MiB short of
the soft point the guard armed (``/api/guard`` ``watch.armed``; for the ticks server,
which arms nothing, the same ``arming.arm_points`` over its latest memory report), waits,
then takes 16 MiB more in one step (from 8 MiB short: the crossing is inside that step);
the time from the step's start to the guard's ``pause_loads`` (its event's sample time, the
wall clock of the same machine) is the outside view, an upper bound that includes the
step's own allocation; a round whose level was already soft before the step (PSI on a
busy machine) is skipped and counted; the guard's own ``reaction`` (notification's
wake-up → action applied) the inside view. Then the neighbour frees everything and the
guard resumes. Writes benchmarks/results/guard_reaction.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from cgroup_v1 import NEIGHBOUR, Cgroup, v1_available
from chaos import Server, until

MiB = 1024**2
LIMIT = 1536 * MiB
LLM = "smollm2-135m"
STEP_MIB = 16  # the step that crosses the point, from half of it short
RESULTS = Path(__file__).parent / "results"
MODES = {
    "events": {"ELBOWROOM_MONITOR_INTERVAL": "60", "ELBOWROOM_PRESSURE_HORIZON": "0"},
    "ticks": {
        "ELBOWROOM_MONITOR_INTERVAL": "1",
        "ELBOWROOM_PRESSURE_HORIZON": "0",
        "ELBOWROOM_PRESSURE_EVENTS": "false",
    },
}


class Neighbour:
    def __init__(self, cg: Cgroup) -> None:
        self.proc = subprocess.Popen(
            cg.command(sys.executable, "-c", NEIGHBOUR),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.send("+0")

    def send(self, line: str) -> float:
        """Returns time.time() when the neighbour had done it."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer.startswith(b"ok"):
            raise RuntimeError(f"the neighbour died on {line!r}")
        return time.time()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def soft_point(http: httpx.Client, cg: Cgroup) -> int:
    """Where the soft level starts, in bytes of cgroup usage: the events server's armed
    point; for the ticks server (no watch) the same computation over its latest sample."""
    from elbowroom.config import Settings
    from elbowroom.guard.arming import arm_points
    from elbowroom.memory.budget import BudgetConfig
    from elbowroom.memory.types import Snapshot

    watch = http.get("/api/guard").json().get("watch") or {}
    if watch.get("armed"):
        return int(watch["armed"][0])
    mem = http.get("/api/memory").json()
    snap = mem["snapshot"]
    fields = {k: snap[k] for k in Snapshot.__dataclass_fields__ if k in snap and k != "psi"}
    fields["gpus"] = ()
    s = Snapshot(**fields)
    points = arm_points(s, int(mem["own_usage"]), BudgetConfig.from_settings(Settings()))
    if not points:
        raise RuntimeError(f"no soft point for {snap}")
    return points[0]


def one_round(http: httpx.Client, cg: Cgroup, n: Neighbour) -> dict[str, Any]:
    point = soft_point(http, cg)
    short = (point - cg.usage) // MiB - STEP_MIB // 2
    if short > 0:
        n.send(f"+{short}")
    time.sleep(1.5)  # let the samples the growth woke settle (pacing, not synchronization)
    state = http.get("/api/guard", params={"events": 1000}).json()
    if state["loads_paused"]:
        return {"skipped": f"soft before the crossing ({state['level']})"}
    seen = len(state["events"])

    def paused() -> dict[str, Any] | None:
        events = http.get("/api/guard", params={"events": 1000}).json()["events"]
        return next((e for e in events[seen:] if e["kind"] == "pause_loads"), None)

    # The point is where the level turns soft if nothing else moves; page cache reclaimed
    # meanwhile moves it up. Step on (8 MiB at a time) until the guard pauses; the time is
    # from the start of the step that got it there.
    extra = 0
    event = None
    while event is None:
        if cg.usage > LIMIT - 48 * MiB:
            raise RuntimeError("the guard did not pause before the limit")
        started = time.time()
        n.send(f"+{STEP_MIB if extra == 0 else STEP_MIB // 2}")
        usage = cg.usage
        try:
            event = until(paused, 3, "the guard to pause loads")
        except TimeoutError:
            extra += 1
    n.send("-")
    until(lambda: not http.get("/api/guard").json()["loads_paused"], 60, "the guard to resume")
    return {
        "outside_ms": round((event["wall"] - started) * 1000, 2),
        "reaction_ms": None if event["reaction"] is None else round(event["reaction"] * 1000, 2),
        "usage_after_step": usage,
        "soft_point": point,
        "extra_steps": extra,
    }


def stats(values: list[float]) -> dict[str, Any]:
    v = sorted(values)
    if not v:
        return {"n": 0}
    return {
        "n": len(v),
        "median": round(statistics.median(v), 2),
        "p99": round(v[math.ceil(0.99 * len(v)) - 1], 2),
        "min": v[0],
        "max": v[-1],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if not v1_available():
        print("needs root and a cgroup v1 memory hierarchy", file=sys.stderr)
        return 2
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    wall = time.monotonic()
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    skipped = dict.fromkeys(MODES, 0)
    with tempfile.TemporaryDirectory(prefix="elbowroom-reaction-") as tmp:
        cgs: dict[str, Cgroup] = {}
        servers: dict[str, Server] = {}
        neighbours: dict[str, Neighbour] = {}
        try:
            for mode, env in MODES.items():
                cgs[mode] = Cgroup(f"elbowroom-reaction-{os.getpid()}-{mode}", LIMIT)
                home = Path(tmp) / mode
                home.mkdir()
                servers[mode] = Server(home, ["--ctx", "1024", "--pin", LLM], cgs[mode], mode, env)
            for mode, server in servers.items():
                until(
                    lambda s=server: any(  # type: ignore[misc]
                        m["id"] == LLM and m["state"] == "ready"
                        for m in s.http.get("/api/elbowroom/ps").json()["models"]
                    ),
                    240,
                    f"{LLM} in the {mode} server",
                )
                neighbours[mode] = Neighbour(cgs[mode])
            for i in range(args.rounds):
                for mode in MODES:  # interleaved: one round of each in turn
                    row = one_round(servers[mode].http, cgs[mode], neighbours[mode])
                    if "skipped" in row:
                        skipped[mode] += 1
                    else:
                        rows[mode].append(row)
                    print(f"round {i + 1} {mode}: {row}", flush=True)
            ooms = {m: cg.oom_kills for m, cg in cgs.items()}
        finally:
            for n in neighbours.values():
                n.close()
            for s in servers.values():
                s.stop()
            for cg in cgs.values():
                cg.remove()
    result = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "loadavg_before": load_before,
            "loadavg_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "rounds": args.rounds,
            "wall_s": round(time.monotonic() - wall, 1),
            "oom_kills": ooms,
            "skipped": skipped,
            "extra_steps": {m: [r["extra_steps"] for r in rows[m]] for m in MODES},
        },
        "summary": {
            m: {
                "outside_ms": stats([r["outside_ms"] for r in rows[m]]),
                "reaction_ms": stats(
                    [r["reaction_ms"] for r in rows[m] if r["reaction_ms"] is not None]
                ),
            }
            for m in MODES
        },
        "rounds": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "guard_reaction.json").write_text(json.dumps(result, indent=1))
    (args.out / "guard_reaction.md").write_text(markdown(result))
    print(json.dumps(result["summary"], indent=1))
    return 0


def markdown(r: dict[str, Any]) -> str:
    m, s = r["meta"], r["summary"]

    def cell(x: dict[str, Any]) -> str:
        if not x.get("n"):
            return "-"
        return f"{x['median']} ({x['min']}–{x['max']}), p99 {x['p99']}"

    return "\n".join(
        [
            "# Guard reaction time: a neighbour crosses the soft point",
            "",
            f"Run {m['date']} on {m['machine']} (**shared with other work**), load average "
            f"before {m['loadavg_before']}, after {m['loadavg_after']}; "
            f"`sudo .venv/bin/python benchmarks/guard_reaction.py --rounds {m['rounds']}` "
            f"({m['wall_s']:.0f} s). {m['rounds']} interleaved rounds per mode; medians "
            "(range), p99 by nearest rank, ms. How it is measured: the module's docstring.",
            "",
            "| mode | crossing → pause_loads, outside (ms) | notification → action, inside (ms) |",
            "|---|---|---|",
            *(
                f"| {mode} | {cell(s[mode]['outside_ms'])} | {cell(s[mode]['reaction_ms'])} |"
                for mode in s
            ),
            "",
            "*events*: the pressure watch on, `monitor_interval` 60 s (only a notification "
            "can answer in time); *ticks*: the watch off, `monitor_interval` 1 s (the "
            "default). *Outside*: from the start of the neighbour's step that crossed the "
            "point (16 MiB from 8 MiB short, then 8 MiB steps while the level was not soft "
            "yet: page cache moves the point; extra steps per round: "
            f"{m['extra_steps']}) to the sample the guard's pause came from (its wall time): "
            "an upper bound that includes the step's own allocation. *Inside*: the guard's "
            "own `reaction`, "
            "from the watch's wake-up to the action applied. The target of issue 23 is "
            "≤ 20 ms at the 99th percentile. OOM kills in the cgroups during the run: "
            f"{m['oom_kills']}. Rounds skipped because the level was soft before the "
            f"crossing: {m['skipped']}.",
            "",
            "In the recorded run round *n* needed *n − 1* extra steps, in both servers alike: "
            "the level turned soft ~8 MiB further from the armed point each round (the point "
            "is computed from the last sample, before the neighbour's previous round left "
            "whatever it left: page cache, its allocator's arenas); the time is taken from "
            "the step that did cross, so the numbers are not affected, but it shows that a "
            "usage threshold is an approximation of the level, not the level itself "
            "(docs/pressure.md).",
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())


def rerender(path: Path) -> None:
    """Write the markdown again from a recorded json (its ``extra_steps`` from the rounds)."""
    r = json.loads(path.read_text())
    r["meta"].setdefault(
        "extra_steps", {m: [x["extra_steps"] for x in rows] for m, rows in r["rounds"].items()}
    )
    path.with_suffix(".md").write_text(markdown(r))

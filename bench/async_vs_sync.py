"""Compare saved local runs of the two modes (bench/async_vs_sync.sh writes them; any run folder
with metrics/ from report.py works). A folder whose name contains "-sync" is the synchronous mode.

    .venv/bin/python bench/async_vs_sync.py --png runs/avs.png runs/avs-*-sync-* runs/avs-*-async-*

Prints per run and the median per mode: the step and seconds into training at which the 5-step
mean reward first reaches 0.8; the same by policy version (ver, ver_s: the first version whose rounds, with
the four versions before it, have a mean reward of 0.8, and when it was published: a step's reward is that
of the samples it trains, generated one version back in sync and one or two in async); steps per minute,
the trainer's idle share (waiting for a batch), tokens generated / leased / trained, staleness; writes one
PNG with reward per step and per second.
"""
from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import report  # noqa: E402


@dataclass
class Args:
    runs: tyro.conf.Positional[tuple[str, ...]]
    """run folders (runs/<run>) holding metrics/ as saved by report.py"""
    png: str = "runs/async_vs_sync.png"
    """where the plot goes"""
    level: float = 0.8
    """the reward level of "first reaches" (5-step mean)"""


def mode_of(path: str) -> str:
    return "sync" if "-sync" in os.path.basename(os.path.normpath(path)) else "async"


def row(path: str, level: float) -> dict:
    train, rollouts, proxy = report.load_dir(path)
    s = report.summarize(train, rollouts, proxy, level)
    hit = s[f"first_reaches_{level}"] or {}
    ver = s[f"first_version_reaches_{level}"] or {}
    return {"run": os.path.basename(os.path.normpath(path)), "mode": mode_of(path), "train": train,
            "step": hit.get("step"), "s": hit.get("wall_s"), "ver": ver.get("version"), "ver_s": ver.get("wall_s"),
            "steps/min": s["steps_per_min"],
            "idle": s["trainer_idle_frac"], "generated": s["tokens_generated"], "leased": s["tokens_leased"],
            "trained": s["tokens_trained"], "stale": s["staleness_mean"], "steps": s["steps"], "wall": s["wall_s"]}


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    colour = {"sync": "tab:blue", "async": "tab:orange"}
    for r in rows:
        t = r["train"]
        rew = [x["reward/mean"] for x in t]
        avg = [statistics.mean(rew[max(0, i - 4):i + 1]) for i in range(len(rew))]  # 5-step mean
        steps, secs = [x["step"] for x in t], [x["wall_s"] for x in t]
        for ax, xs in ((a1, steps), (a2, secs)):
            ax.plot(xs, rew, ".", color=colour[r["mode"]], alpha=.35)
            ax.plot(xs, avg, "-", color=colour[r["mode"]], label=f"{r['run']} (5-step mean)")
    for ax, label in ((a1, "trainer step"), (a2, "seconds into training")):
        ax.axhline(0.8, color="grey", lw=.8, ls="--")
        ax.set_xlabel(label); ax.grid(alpha=.3)
    a1.set_ylabel("reward (batch mean)"); a1.set_ylim(-0.02, 1.02)
    a2.legend(fontsize=7, loc="lower right")
    fig.suptitle("strictly synchronous (blue) vs async (orange): reward per step and per second")
    fig.tight_layout(); fig.savefig(path, dpi=110)


def main(args: Args) -> None:
    if not args.runs:
        raise SystemExit("give the run folders to compare, e.g. runs/avs-*-sync-* runs/avs-*-async-*")
    rows = [row(p, args.level) for p in args.runs]
    cols = ["run", "step", "s", "ver", "ver_s", "steps/min", "idle", "generated", "leased", "trained", "stale", "steps", "wall"]
    print(f"first reaches {args.level}: step, s = seconds into training; ver, ver_s = the policy version and when it was "
          "published; idle = trainer waiting for a batch")
    print("  ".join(f"{c:>10s}" if c != "run" else f"{c:34s}" for c in cols))
    for r in rows:
        print("  ".join(f"{fmt(r[c]):>10s}" if c != "run" else f"{r[c]:34s}" for c in cols))
    for mode in ("sync", "async"):
        rs = [r for r in rows if r["mode"] == mode]
        if not rs:
            continue
        med = {c: statistics.median([r[c] for r in rs if r[c] is not None]) if any(r[c] is not None for r in rs) else None
               for c in cols[1:]}
        never = sum(r["step"] is None for r in rs)
        print(f"median {mode} ({len(rs)} runs{f', {never} never reached {args.level}' if never else ''}): "
              + "  ".join(f"{c} {fmt(med[c])}" for c in cols[1:]))
    plot(rows, args.png)
    print(f"plot: {args.png}")


if __name__ == "__main__":
    main(tyro.cli(Args))

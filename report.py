"""Summary and reward curve of a run, read from its metrics JSONL in the bucket.

    python report.py --out runs/my-run          # env: BUCKET, RUN_NAME, S3_ENDPOINT_URL

Prints: reward of the first 5 vs last 5 steps, reward per policy version, versions published,
staleness mean/max, groups dropped, medians of the wait/sync timings, peak memory per role; then
the configuration every role recorded at start (config/ in the bucket: command, package versions,
sha256 of the files, host), which is what it takes to run it again. Writes OUT/reward_curve.png,
OUT/summary.json and OUT/configs.json.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Bucket  # noqa: E402


@dataclass
class Args:
    out: str = "."
    """folder for reward_curve.png and summary.json"""


def read_jsonl(bucket: Bucket, rel: str) -> list[dict]:
    got = bucket.get(rel)
    return [json.loads(line) for line in got[0].decode().splitlines() if line.strip()] if got else []


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def summarize(train: list[dict], rollouts: dict[str, list[dict]], proxy: list[dict]) -> dict:
    rewards = [r["reward/mean"] for r in train]
    by_version: dict[int, list[float]] = {}
    for rows in rollouts.values():
        for r in rows:
            if "rollout/reward_mean" in r:
                by_version.setdefault(r["version"], []).append((r["rollout/reward_mean"], r["rollout/samples"]))
    per_version = {v: round(sum(m * n for m, n in xs) / sum(n for _, n in xs), 3) for v, xs in sorted(by_version.items())}
    roll_rows = [r for rows in rollouts.values() for r in rows]
    last_proxy = proxy[-1] if proxy else {}
    return {
        "steps": len(train),
        "reward_first5": round(statistics.mean(rewards[:5]), 3) if rewards else None,
        "reward_last5": round(statistics.mean(rewards[-5:]), 3) if rewards else None,
        "reward_per_version": per_version,
        "versions_published": max((r["version"] for r in train), default=0),
        "staleness_mean": round(statistics.mean(r["sample/staleness_mean"] for r in train), 3) if train else None,
        "staleness_max": max((r["sample/staleness_max"] for r in train), default=None),
        "groups_dropped_stale": last_proxy.get("proxy/groups_dropped_stale"),
        "ratio_onpolicy_mean": med([r["ratio/onpolicy_mean"] for r in train if "ratio/onpolicy_mean" in r]),
        "ratio_onpolicy_range": [round(f(r["ratio/onpolicy_mean"] for r in train if r.get("ratio/onpolicy_mean")), 4)
                                 for f in (min, max)] if any("ratio/onpolicy_mean" in r for r in train) else None,
        "median_rollout_wait_s": med([r["perf/rollout_wait_s"] for r in train]),
        "median_backpressure_s": med([r["rollout/backpressure_s"] for r in train]),
        "median_step_s": med([r["perf/step_s"] for r in train]),
        "median_weight_sync_s": med([r["perf/weight_sync_s"] for r in roll_rows if "perf/weight_sync_s" in r]),
        "median_version_lag_s": med([r["rollout/version_lag_s"] for r in roll_rows if "rollout/version_lag_s" in r]),
        "wall_s": round(train[-1]["wall_s"], 1) if train else None,
        "peak_rss_mb": {"trainer": max((r["mem/peak_rss_mb"] for r in train), default=None),
                        **{k: max(r["mem/peak_rss_mb"] for r in rows) for k, rows in rollouts.items() if rows},
                        "proxy": max((r["mem/peak_rss_mb"] for r in proxy), default=None)},
    }


def read_configs(bucket: Bucket) -> list[dict]:
    """Every role start's recorded configuration (runconfig.record_config), oldest first."""
    cfgs = [bucket.get_json(k) for k in bucket.list("config/") if k.endswith(".json")]
    return sorted((c for c in cfgs if c), key=lambda c: c.get("started_at", 0))


def format_config(c: dict) -> str:
    """Four lines per role start: who and where, versions, file hashes, the command."""
    versions = ", ".join(f"{k} {v}" for k, v in c.get("versions", {}).items() if v)
    hashes = "  ".join(f"{k} {v[:12]}" for k, v in c.get("sha256", {}).items())
    where = f"{c['host']} pid {c['pid']}" + (f", {c['device']}" if c.get("device") else "")
    return (f"  {c['role']:18s} {c['started_at_utc']}  {where}\n    versions: {versions}\n"
            f"    sha256:   {hashes}\n    command:  {c['command']}")


def plot(train: list[dict], rollouts: dict[str, list[dict]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    import numpy as np
    steps, wall = [r["step"] for r in train], [r["wall_s"] / 60 for r in train]
    a1.plot(steps, [r["reward/mean"] for r in train], "o-", ms=3, label="trainer batch")
    a1.set_xlabel("step"); a1.set_ylabel("reward"); a1.set_ylim(-0.02, 1.02); a1.grid(alpha=.3)
    # wall time on the top axis, mapped from the steps (monotonic both ways)
    top = a1.secondary_xaxis("top", functions=(lambda x: np.interp(x, steps, wall), lambda w: np.interp(w, wall, steps)))
    top.set_xlabel("wall time (min)")
    for name, rows in rollouts.items():
        rows = [r for r in rows if "rollout/reward_mean" in r]
        a2.plot([r["version"] for r in rows], [r["rollout/reward_mean"] for r in rows], ".", alpha=.5, label=name)
    a2.set_xlabel("policy version that generated the round"); a2.set_ylabel("reward"); a2.grid(alpha=.3)
    a2.legend(fontsize=7)
    fig.suptitle("async GRPO: reward per step (left) and per adapter version (right)")
    fig.tight_layout(); fig.savefig(path, dpi=110)


def main(args: Args) -> None:
    bucket = Bucket()
    train = read_jsonl(bucket, "metrics/train.jsonl")
    rollouts = {k.split("/")[-1][:-6]: read_jsonl(bucket, k) for k in bucket.list("metrics/rollout-")}
    proxy = read_jsonl(bucket, "metrics/proxy.jsonl")
    s = summarize(train, rollouts, proxy)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    print("\n== summary of run", bucket.run, "==")
    for k, v in s.items():
        print(f"  {k:24s} {v}")
    if train:
        plot(train, rollouts, os.path.join(args.out, "reward_curve.png"))
        print(f"  reward curve             {os.path.join(args.out, 'reward_curve.png')}")
    configs = read_configs(bucket)
    with open(os.path.join(args.out, "configs.json"), "w") as f:
        json.dump(configs, f, indent=1)
    print(f"\n== configuration of each role start ({len(configs)}; all fields in {os.path.join(args.out, 'configs.json')}) ==")
    for c in configs:
        print(format_config(c))


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Args))

"""Summary and reward curve of a run, read from its metrics JSONL in the bucket (or a saved copy).

    python report.py --out runs/my-run          # env: BUCKET, RUN_NAME, S3_ENDPOINT_URL
    python report.py --from-dir runs/my-run     # again, offline, from the copy a first call saved

Prints: when the 5-step mean reward first reaches 0.8 (step and seconds into training), reward of
the first 5 vs last 5 steps, reward per policy version, steps per minute, the trainer's idle share,
tokens generated / leased / trained, staleness mean/max and a per-staleness table (groups, reward,
|ratio - 1|, clip fraction), groups dropped, medians of the wait/sync timings, peak memory per role;
then the configuration every role recorded at start (config/ in the bucket: command, package
versions, sha256 of the files, host), which is what it takes to run it again. Writes
OUT/reward_curve.png, OUT/summary.json, OUT/configs.json and OUT/metrics/*.jsonl (the rows it read).
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys
from dataclasses import dataclass

# common first: importing it puts the lib/ folders on sys.path (in a job every file lands beside this one)
from common import Bucket


@dataclass
class Args:
    out: str = "."
    """folder for reward_curve.png, summary.json and metrics/ (a copy of the rows read)"""
    from_dir: str | None = None
    """read OUT/metrics/*.jsonl saved by an earlier call instead of the bucket (then --out defaults to it)"""
    level: float = 0.8
    """the reward level of "first reaches" (5-step mean)"""


def read_jsonl(bucket: Bucket, rel: str) -> list[dict]:
    got = bucket.get(rel)
    return [json.loads(line) for line in got[0].decode().splitlines() if line.strip()] if got else []


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def first_reaching(train: list[dict], level: float = 0.8, window: int = 5) -> dict | None:
    """The first step at which the mean reward of the last `window` steps is >= level, and its
    time into training (the trainer's wall_s), or None."""
    rewards = [r["reward/mean"] for r in train]
    for i in range(window - 1, len(rewards)):
        if statistics.mean(rewards[i - window + 1:i + 1]) >= level:
            return {"step": train[i]["step"], "wall_s": round(train[i]["wall_s"], 1)}
    return None


def by_staleness(train: list[dict]) -> dict[int, dict]:
    """Over the whole run, per staleness: groups, mean reward, mean and max |ratio - 1| and clip
    fraction over the trained tokens (from the trainer's stale/<s>/* keys)."""
    acc: dict[int, dict] = {}
    for row in train:
        for k, v in row.items():
            if not (k.startswith("stale/") and k.endswith("/groups")):
                continue
            lag = int(k.split("/")[1])
            a = acc.setdefault(lag, {"groups": 0, "reward": 0.0, "tokens": 0, "dev": 0.0, "dev_max": 0.0, "clipped": 0.0})
            pre, tok = f"stale/{lag}/", row.get(f"stale/{lag}/tokens", 0)
            a["groups"] += v
            a["reward"] += row.get(pre + "reward", 0.0) * v  # none: tokens of a mid-round swap's version, no group
            if tok:
                a["tokens"] += tok
                a["dev"] += row[pre + "ratio_dev_mean"] * tok
                a["dev_max"] = max(a["dev_max"], row[pre + "ratio_dev_max"])
                a["clipped"] += row[pre + "clip_frac"] * tok
    return {lag: {"groups": a["groups"], "reward": round(a["reward"] / a["groups"], 3) if a["groups"] else None,
                  "tokens": a["tokens"],
                  "ratio_dev_mean": round(a["dev"] / a["tokens"], 4) if a["tokens"] else None,
                  "ratio_dev_max": round(a["dev_max"], 4) if a["tokens"] else None,
                  "clip_frac": round(a["clipped"] / a["tokens"], 4) if a["tokens"] else None}
            for lag, a in sorted(acc.items())}


def first_last(train: list[dict], key: str) -> list[float] | None:
    """The mean of `key` over the first 5 and the last 5 steps that have it (None: no step has it)."""
    xs = [r[key] for r in train if key in r]
    return [round(statistics.mean(xs[:5]), 3), round(statistics.mean(xs[-5:]), 3)] if xs else None


def summarize(train: list[dict], rollouts: dict[str, list[dict]], proxy: list[dict], level: float = 0.8) -> dict:
    rewards = [r["reward/mean"] for r in train]
    by_version: dict[int, list[float]] = {}
    for rows in rollouts.values():
        for r in rows:
            if "rollout/reward_mean" in r:
                by_version.setdefault(r["version"], []).append((r["rollout/reward_mean"], r["rollout/samples"]))
    per_version = {v: round(sum(m * n for m, n in xs) / sum(n for _, n in xs), 3) for v, xs in sorted(by_version.items())}
    roll_rows = [r for rows in rollouts.values() for r in rows]
    last_proxy = proxy[-1] if proxy else {}
    wall = train[-1]["wall_s"] if train else None
    return {
        "steps": len(train),
        f"first_reaches_{level}": first_reaching(train, level),
        "reward_first5": round(statistics.mean(rewards[:5]), 3) if rewards else None,
        "reward_last5": round(statistics.mean(rewards[-5:]), 3) if rewards else None,
        "reward_per_version": per_version,
        # episodes of several turns (environments.py): the share answered right, the share that called the tool
        **({"success_first5_last5": first_last(train, "reward/correct")} if any("reward/correct" in r for r in train) else {}),
        **({"tool_call_share_first5_last5": first_last(train, "reward/diag_tool_call")}
           if any("reward/diag_tool_call" in r for r in train) else {}),
        **({"turns_first5_last5": first_last(train, "reward/diag_turns")} if any("reward/diag_turns" in r for r in train) else {}),
        "versions_published": max((r["version"] for r in train), default=0),
        "wall_s": round(wall, 1) if train else None,
        "steps_per_min": round(len(train) / (wall / 60), 2) if wall else None,
        # the trainer waiting for a batch (starved of rollouts), as a share of its time
        "trainer_idle_frac": round(sum(r["perf/rollout_wait_s"] for r in train) / wall, 3) if wall else None,
        "tokens_generated": round(sum(r["rollout/tokens_per_s"] * r["rollout/gen_s"] for r in roll_rows
                                      if "rollout/gen_s" in r)),
        "tokens_leased": sum(r.get("tokens/leased", 0) for r in train),
        "tokens_trained": sum(r.get("tokens", 0) for r in train),
        "staleness_mean": round(statistics.mean(r["sample/staleness_mean"] for r in train), 3) if train else None,
        "staleness_max": max((r["sample/staleness_max"] for r in train), default=None),
        "by_staleness": by_staleness(train),
        "groups_dropped_stale": last_proxy.get("proxy/groups_dropped_stale"),
        "ratio_onpolicy_mean": med([r["ratio/onpolicy_mean"] for r in train if "ratio/onpolicy_mean" in r]),
        "ratio_onpolicy_range": [round(f(r["ratio/onpolicy_mean"] for r in train if r.get("ratio/onpolicy_mean")), 4)
                                 for f in (min, max)] if any("ratio/onpolicy_mean" in r for r in train) else None,
        "median_rollout_wait_s": med([r["perf/rollout_wait_s"] for r in train]),
        "median_backpressure_s": med([r["rollout/backpressure_s"] for r in train]),
        "median_step_s": med([r["perf/step_s"] for r in train]),
        "median_weight_sync_s": med([r["perf/weight_sync_s"] for r in roll_rows if "perf/weight_sync_s" in r]),
        "median_version_lag_s": med([r["rollout/version_lag_s"] for r in roll_rows if "rollout/version_lag_s" in r]),
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


def headline(s: dict, level: float = 0.8) -> str:
    """The one line to compare runs by."""
    hit = s.get(f"first_reaches_{level}")
    if hit is None:
        return f"5-step mean reward never reached {level} in {s['steps']} steps ({s['wall_s']} s)"
    return f"5-step mean reward first reaches {level} at step {hit['step']}, {hit['wall_s']:.0f} s into training"


def plot(train: list[dict], rollouts: dict[str, list[dict]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    import numpy as np
    steps, wall = [r["step"] for r in train], [r["wall_s"] / 60 for r in train]
    a1.plot(steps, [r["reward/mean"] for r in train], "o-", ms=3, label="reward (trainer batch)")
    if any("reward/diag_tool_call" in r for r in train):  # a tool-using environment: how often the tool was called
        a1.plot([r["step"] for r in train if "reward/diag_tool_call" in r],
                [r["reward/diag_tool_call"] for r in train if "reward/diag_tool_call" in r], "s--", ms=3,
                label="episodes calling the tool")
        a1.legend(fontsize=7)
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


def load_dir(d: str) -> tuple[list[dict], dict[str, list[dict]], list[dict]]:
    """The rows a previous call saved under d/metrics/."""
    def rows(p: str) -> list[dict]:
        with open(p) as f:
            return [json.loads(line) for line in f if line.strip()]
    m = os.path.join(d, "metrics")
    if not os.path.exists(os.path.join(m, "train.jsonl")):
        raise SystemExit(f"{m}/train.jsonl does not exist: run report.py --out {d} against the run's bucket first")
    rollouts = {os.path.basename(p)[len("rollout-"):-len(".jsonl")]: rows(p)
                for p in sorted(glob.glob(os.path.join(m, "rollout-*.jsonl")))}
    proxy = rows(os.path.join(m, "proxy.jsonl")) if os.path.exists(os.path.join(m, "proxy.jsonl")) else []
    return rows(os.path.join(m, "train.jsonl")), rollouts, proxy


def save_dir(d: str, train: list[dict], rollouts: dict[str, list[dict]], proxy: list[dict]) -> None:
    os.makedirs(os.path.join(d, "metrics"), exist_ok=True)
    for name, rows in [("train", train), ("proxy", proxy), *((f"rollout-{k}", v) for k, v in rollouts.items())]:
        with open(os.path.join(d, "metrics", f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def main(args: Args) -> None:
    if args.from_dir:
        out = args.out if args.out != "." else args.from_dir
        train, rollouts, proxy = load_dir(args.from_dir)
        name = os.path.basename(os.path.abspath(args.from_dir))
        saved = os.path.join(args.from_dir, "configs.json")
        configs = json.load(open(saved)) if os.path.exists(saved) else []
    else:
        out, bucket = args.out, Bucket()
        train = read_jsonl(bucket, "metrics/train.jsonl")
        rollouts = {k.split("/")[-1][len("rollout-"):-len(".jsonl")]: read_jsonl(bucket, k) for k in bucket.list("metrics/rollout-")}
        proxy = read_jsonl(bucket, "metrics/proxy.jsonl")
        name = bucket.run
        configs = read_configs(bucket)
        save_dir(out, train, rollouts, proxy)
    s = summarize(train, rollouts, proxy, args.level)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    with open(os.path.join(out, "configs.json"), "w") as f:
        json.dump(configs, f, indent=1)
    print("\n== summary of run", name, "==")
    for k, v in s.items():
        if k != "by_staleness":
            print(f"  {k:24s} {v}")
    print("  by staleness             groups  reward  |ratio-1| mean  max     clip frac")
    for lag, d in s["by_staleness"].items():
        dev = f"{d['ratio_dev_mean']:.4f}  {d['ratio_dev_max']:.4f}  {d['clip_frac']:.4f}" if d["tokens"] else "(not trained)"
        reward = "  -  " if d["reward"] is None else f"{d['reward']:.3f}"  # tokens only: a mid-round swap's version
        print(f"    {lag:<22d} {d['groups']:6d}  {reward}   {dev}")
    if train:
        plot(train, rollouts, os.path.join(out, "reward_curve.png"))
        print(f"  reward curve             {os.path.join(out, 'reward_curve.png')}")
    print(f"\n== configuration of each role start ({len(configs)}; all fields in {os.path.join(out, 'configs.json')}) ==")
    for c in configs:
        print(format_config(c))
    print(headline(s, args.level))


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Args))

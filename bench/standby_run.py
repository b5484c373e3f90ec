"""A whole local run with a standby proxy, its leader killed (kill -9) several times mid-run: does it still learn?

    .venv/bin/python bench/standby_run.py                        # kill -9 the leader at steps 4 and 9, 20 steps
    .venv/bin/python bench/standby_run.py --kill-at 3 6 9 --steps 40

Runs `bash launch_jobs.sh --local --standby` as a user would (fresh run name, the `local` preset). Once the
trainer's log shows step k for each k of --kill-at, it asks each proxy the launcher lists in runs/<run>/proxies for
its /health, kills the one whose role is `leader`, and times until another proxy says it leads. The launcher
starts a standby in the killed one's place (launch_jobs.sh, tend_proxies), so each kill finds a standby ready.
Prints each kill (step, pid, failover seconds), then the launcher's summary (report.py: reward per step, the step at
which the 5-step mean first reaches 0.8) and the launcher's exit status.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import tyro

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"step\s+(\d+)\s+reward")


@dataclass
class Args:
    kill_at: list[int] = field(default_factory=lambda: [4, 9])
    """the trainer's steps after which the leader is killed"""
    steps: int = 20
    run: str = ""
    """the run's name (default: standby-<time>)"""
    timeout_s: float = 3600.0


def proxies(out: Path) -> list[tuple[int, str]]:
    """(pid, url) of each proxy the launcher runs now."""
    f = out / "proxies"
    rows = [line.split() for line in f.read_text().splitlines()] if f.is_file() else []
    return [(int(pid), url) for pid, url in rows]


def role(url: str) -> str | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).json().get("role")
    except (httpx.HTTPError, ValueError):
        return None


def leader(out: Path) -> tuple[int, str] | None:
    return next((p for p in proxies(out) if role(p[1]) == "leader"), None)


def kill_leader(out: Path) -> tuple[int, float]:
    """kill -9 the proxy that leads; (its pid, seconds until another proxy's /health says it leads)."""
    t_end = time.time() + 60
    while (old := leader(out)) is None:
        if time.time() > t_end:
            raise SystemExit("no proxy says it leads")
        time.sleep(0.2)
    t0 = time.monotonic()
    os.kill(old[0], signal.SIGKILL)
    while True:
        new = [p for p in proxies(out) if p[0] != old[0] and role(p[1]) == "leader"]
        if new:
            return old[0], time.monotonic() - t0
        if time.monotonic() - t0 > 60:
            raise SystemExit("no proxy led within 60 s of the kill")
        time.sleep(0.05)


def main(a: Args) -> int:
    run = a.run or time.strftime("standby-%Y%m%d-%H%M%S")
    out = ROOT / "runs" / run
    env = {k: v for k, v in os.environ.items() if k not in ("BUCKET", "S3_ENDPOINT_URL", "PROXY_URL", "PROXY_TOKEN",
                                                            "RUN_NAME", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    cmd = ["bash", str(ROOT / "launch_jobs.sh"), "--local", "--standby", "--steps", str(a.steps), "--run", run]
    print("$", " ".join(cmd), flush=True)
    said = tempfile.TemporaryFile("w+")  # not a pipe: the trainer's progress would fill it while we wait
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=said, stderr=subprocess.STDOUT, text=True)
    kills, t0 = [], time.time()
    try:
        for k in sorted(a.kill_at):
            while not (out / "train.log").is_file() or max(map(int, STEP.findall((out / "train.log").read_text())),
                                                           default=0) < k:
                if launcher.poll() is not None or time.time() - t0 > a.timeout_s:
                    raise SystemExit(f"the run ended (or timed out) before step {k}")
                time.sleep(1)
            pid, took = kill_leader(out)
            kills.append((k, pid, took))
            print(f"after step {k}: killed the leader (pid {pid}); another proxy led {took:.2f} s later", flush=True)
        launcher.wait(timeout=max(60.0, a.timeout_s - (time.time() - t0)))
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)  # its trap stops every process it started
            launcher.wait(120)
    said.seek(0)
    text = said.read()
    summary = text[text.find("== summary"):text.find("== configuration")] if "== summary" in text else text[-3000:]
    print(summary + "\n".join(text.rstrip().splitlines()[-1:]))  # report.py's summary, and its headline
    print(f"launcher exit status {launcher.returncode}; {len(kills)} leader kill(s): "
          + ", ".join(f"step {k} ({took:.2f} s)" for k, _, took in kills))
    return launcher.returncode


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))

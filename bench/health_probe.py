"""Asks a proxy's GET /health every --every-s seconds from a process of its own and writes each answer's
latency (seconds, one per line) to --out, until it is stopped (SIGTERM) or the proxy stops answering for
--give-up-s. /health does nothing but answer, so its latency is how long a request waits for the proxy's
event loop. bench/fleet_sim.py runs it beside its simulated fleet: a probe inside the simulator, whose one
process drives every worker, would add the simulator's own event-loop lag to the proxy's.

    python bench/health_probe.py --url http://127.0.0.1:8000 --out health.txt
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

import httpx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the proxy's base URL")
    p.add_argument("--out", required=True, help="file to append latencies to, one per line, in seconds")
    p.add_argument("--every-s", type=float, default=0.1)
    p.add_argument("--give-up-s", type=float, default=60.0)
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    last_ok = time.monotonic()
    with httpx.Client(base_url=a.url, timeout=30.0) as http, open(a.out, "a", buffering=1) as out:
        while time.monotonic() - last_ok < a.give_up_s:
            t0 = time.monotonic()
            try:
                http.get("/health").raise_for_status()
            except httpx.HTTPError:
                time.sleep(a.every_s)
                continue
            last_ok = time.monotonic()
            out.write(f"{last_ok - t0:.6f}\n")
            time.sleep(max(0.0, a.every_s - (time.monotonic() - t0)))


if __name__ == "__main__":
    main()

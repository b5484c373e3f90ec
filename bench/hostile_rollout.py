"""rollout.py as a hostile participant would run it (issue #44's table): the real worker (its engine, leases, spool),
whose first groups each carry one of the table's hostile values in turn, the rest of the group as the worker made it;
and, beside it, the table's two lease attacks. Every send's answer (status and the proxy's words) goes to
--hostile-log (JSON lines). Used by bench/participants_run.py --mallory hostile; after its hostile groups it works on
honestly (what the audit then does with a participant that failed a check: every later group of it recomputed).
Each hostile group is posted by this script first, raw, so that the log holds the proxy's own answer to it; the worker
then sends it as any group (`duplicate` where the proxy took it; its spool sets aside what the proxy refused).

    PROXY_URL=... PROXY_TOKEN=<a participant's worker token> .venv/bin/python bench/hostile_rollout.py \\
        --hostile-log runs/hostile.jsonl --task addition

The rows (issue #44; what stops each: docs/trust.md#what-one-group-may-not-do):
  1a meta.timings "x"               1b meta.reward_components [1]
  2  meta.temperature 1e-300        3  meta.temperature 1e-39 (a float32 subnormal)
  4  one behaviour logprob -100     4b one behaviour logprob -45 (within the door's floor: the trainer's to judge)
  5  one token id past the vocabulary (49152, SmolLM2's size)
  6  a prompt lease of the run's dataset with the wrong size: before the trainer opened it, and after
  7  prompt leases of 64 made-up dataset names
"""
import json
import os
import sys
import threading
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rollout  # noqa: E402 - puts the lib/ folders on sys.path (common)
from common import sampled_mask  # noqa: E402

VOCAB = 49152  # SmolLM2-135M's vocabulary (the proxy's default --vocab-size)


def first_sampled(c: dict) -> int:
    return sampled_mask(c).index(1)


def set_meta(key: str, value, g: dict) -> None:
    g["meta"][key] = value


def set_logprob(value: float, g: dict) -> None:
    c = g["completions"][0]
    c["logprobs"][first_sampled(c)] = value


def set_token(value: int, g: dict) -> None:
    c = g["completions"][0]
    c["token_ids"][first_sampled(c)] = value


ROWS = [("1a meta.timings 'x'", partial(set_meta, "timings", "x")),
        ("1b meta.reward_components [1]", partial(set_meta, "reward_components", [1])),
        ("2 meta.temperature 1e-300", partial(set_meta, "temperature", 1e-300)),
        ("3 meta.temperature 1e-39", partial(set_meta, "temperature", 1e-39)),
        ("4 a behaviour logprob -100", partial(set_logprob, -100.0)),
        ("4b a behaviour logprob -45", partial(set_logprob, -45.0)),
        ("5 a token id past the vocabulary (49152)", partial(set_token, VOCAB))]
"""(row, what it does to a group the worker made), in the order they are sent"""


class Hostile:
    """The worker's group_record, wrapped: each new group gets the next hostile row and is posted here first (raw: only
    a 429 is waited out and sent again), so that the log holds the proxy's own answer; the worker then sends it as it
    sends any group (the proxy answers `duplicate` to what it took, and the worker's spool sets aside what it refused)."""

    def __init__(self, url: str, token: str, log_path: str, honest_record):
        import httpx
        from common import PROTOCOL
        self.http = httpx.Client(base_url=url, headers={"X-Proxy-Token": token, "X-Protocol": str(PROTOCOL)}, timeout=60)
        self.rows, self.log_path, self.lock, self.honest_record = list(ROWS), log_path, threading.Lock(), honest_record

    def write(self, record: dict) -> None:
        with self.lock, open(self.log_path, "a") as f:
            f.write(json.dumps({"at": round(time.time(), 3), **record}) + "\n")

    def __call__(self, *a, **k) -> dict:
        g = self.honest_record(*a, **k)
        if self.rows:
            row, edit = self.rows.pop(0)
            edit(g)
            while (r := self.http.post("/v1/groups", json=g)).status_code == 429:  # buffer full: as ProxyClient
                time.sleep(float(r.headers.get("Retry-After", "1")))
            self.write({"row": row, "group_id": g["group_id"], "policy_version": g["policy_version"],
                        "status": r.status_code, "answer": r.text[:400]})
        return g


def lease_once(http, log: Hostile, row: str, name: str, n: int, write: bool = True) -> int:
    """One prompt lease of dataset `name` at size n, its answer logged under `row` (write); its status."""
    r = http.post("/v1/prompts/lease", json={"dataset": name, "size": n, "n": 4})
    if write:
        log.write({"row": row, "status": r.status_code, "answer": r.text[:400]})
    return r.status_code


def lease_attacks(dataset: str, size: int, log: Hostile) -> None:
    """Rows 6 and 7, raw (no retries, so each answer is the proxy's first): the run's dataset at the wrong size before
    the trainer opened it and once it is open, and 64 made-up dataset names."""
    http = log.http

    lease = partial(lease_once, http, log)
    lease("6 wrong size, before the trainer opened the dataset", dataset, size + 1)
    codes = [lease("7", f"made-up-{k}", 100, write=False) for k in range(64)]
    log.write({"row": "7 64 made-up dataset names", "status": sorted(set(codes)), "answer":
               http.post("/v1/prompts/lease", json={"dataset": "made-up-0", "size": 100, "n": 4}).text[:400],
               "statuses": {str(c): codes.count(c) for c in set(codes)}})
    while http.get("/v1/whoami").status_code == 200:  # the trainer opens the dataset at its start
        if lease("6", dataset, size + 1, write=False) != 503:
            lease("6 wrong size, the dataset open", dataset, size + 1)
            break
        time.sleep(2)


if __name__ == "__main__":  # rollout.py's own __main__, the hostile values in place
    import tyro
    from common import script_args
    from tasks import load_task
    argv = script_args()
    where = argv.index("--hostile-log")
    log_path = argv[where + 1]
    del argv[where:where + 2]
    args = tyro.cli(rollout.Args, args=argv)
    rollout.group_record = log = Hostile(args.proxy_url, args.proxy_token, log_path, rollout.group_record)
    task = load_task(args.task)
    threading.Thread(target=lease_attacks, args=(task.name, len(task.prompts), log), daemon=True).start()
    rollout.main(args)
    rollout.leave()

"""Where every generated token went (lib/proxy/token_outcomes.py): on a real run of proxy, worker and trainer, the
outcomes replayed from the proxy's journal add up to the tokens the worker counted, and each is checked against a
counter the proxy or the trainer kept on its own; report.py prints the table and the run's dollars."""
import json
import os
import subprocess
import sys

import pytest

import costs
import report
from conftest import ROOT, stop
from runlib import tiny_loop
import token_outcomes

READ = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
print(json.dumps({name: SQLiteStorage.get_logs("grpo-test", name) for name in sys.argv[1:]}, default=str))
"""


def test_the_ledger_adds_up_on_a_real_run(tiny_model, start_proxy, bucket, run_name, tmp_path, monkeypatch, capsys):
    """Unpaced, with a buffer of 2 and max staleness 1, so that the worker runs ahead and groups go stale or are
    never leased; every group trained (--no-skip-zero-std: the tiny random model's rewards are all equal).
    generated = the sum of the outcomes, and every cross-check holds."""
    proxy = start_proxy("--group-size", "4", "--max-buffer", "2", "--max-staleness", "1", "--no-pace")
    tiny_loop(tiny_model, proxy, run_name, tmp_path, 4)
    stop(proxy.proc)  # its metrics are uploaded as it exits: its last row holds its final counters
    monkeypatch.setenv("RUN_NAME", run_name)
    report.main(report.Args(out=str(tmp_path / "out"), adapters="none"))
    printed = capsys.readouterr().out
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    acc = s["token_outcomes"]
    tok = acc["tokens"]
    assert acc["generated"] == s["tokens_generated"] > 0               # the worker's own count
    assert sum(tok.values()) == acc["generated"], tok
    assert all(c["ok"] for c in acc["checks"]), acc["checks"]
    assert len(acc["checks"]) == 6 and "MISMATCH" not in printed
    assert tok["trained"] > 0 and tok["dropped_stale"] + tok["never_leased"] > 0 and tok["released_scale_down"] == 0
    assert tok["not_sent"] >= 0 and acc["journal_tokens"] == sum(tok.values()) - tok["not_sent"]
    # per version and per participant, the same tokens: each adds up to the total of each outcome
    for table in (acc["by_version"], acc["by_participant"]):
        assert {k: sum(row[k] for row in table.values()) for k in token_outcomes.OUTCOMES if k != "not_sent"} == \
            {k: n for k, n in tok.items() if k != "not_sent"}
    assert set(acc["by_participant"]) == {token_outcomes.RUN}         # the run's own worker: no participant
    # a local run: its processes have no flavor, $0, no GPU-seconds; the seconds each ran are told
    assert set(s["job_costs"]) == {"train", "proxy", "rollout-w1"}
    assert all(c["flavor"] == costs.LOCAL and c["usd"] == 0 and c["seconds"] > 0 for c in s["job_costs"].values())
    assert s["usd_total"] == 0 and s["usd_per_trained_token"] in (0, None)
    assert "where the" in printed and "generated tokens went" in printed
    assert (tmp_path / "out" / "token_outcomes.png").stat().st_size > 0
    # offline, from the saved copy, as a user runs it: the same table, and to trackio the same rows (offline)
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "TRACKIO_PROJECT": "grpo-test", "HF_HUB_OFFLINE": "1",
           "HF_ENDPOINT": "http://127.0.0.1:9"}   # nothing listens there: trackio must not need the network
    p = subprocess.run([sys.executable, str(ROOT / "report.py"), "--from-dir", str(tmp_path / "out"), "--report-to",
                        "trackio"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "trackio disabled" not in p.stderr, p.stdout + p.stderr
    again = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert again["token_outcomes"] == acc
    p = subprocess.run([sys.executable, "-c", READ, "out-ledger"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    logged = json.loads(p.stdout.strip().splitlines()[-1])["out-ledger"]
    assert [r["step"] for r in logged[:-1]] == [int(v) for v in acc["by_version"]]
    for row, (v, want) in zip(logged, acc["by_version"].items()):
        assert {k: row[f"tokens/{k}"] for k in token_outcomes.OUTCOMES} == want, v
    assert {k: logged[-1][f"total/{k}"] for k in token_outcomes.OUTCOMES} == tok
    assert logged[-1]["tokens/generated"] == acc["generated"] and logged[-1]["usd_total"] == 0


def test_job_costs_price_each_flavor_over_its_span():
    """An a10g-small trainer for an hour and an l4x1 worker for half of it: $1.00 and $0.40, GPU-seconds per GPU;
    spent by 30 minutes in: $0.50 + $0.40. A flavor without a price is refused by name, not guessed."""
    spent = costs.job_costs({"train": (0.0, 3600.0), "rollout-w1": (0.0, 1800.0), "proxy": (0.0, 3600.0)},
                            {"train": "a10g-small", "rollout-w1": "l4x1", "proxy": "cpu-basic"})
    assert spent["train"]["usd"] == 1.0 and spent["rollout-w1"]["usd"] == 0.4 and spent["proxy"]["usd"] == 0.01
    assert spent["train"]["gpu_seconds"] == 3600 and spent["proxy"]["gpu_seconds"] == 0
    assert costs.spent_by(spent, 1800.0) == 0.5 + 0.4 + 0.005
    assert costs.job_costs({"train": (0.0, 7200.0)}, {"train": "h200x2"})["train"]["gpu_seconds"] == 14400
    with pytest.raises(ValueError, match="'b200' has no price"):
        costs.job_costs({"train": (0.0, 1.0)}, {"train": "b200"})
    plan = {"jobs": [{"role": "trainer", "flavor": "a10g-small", "args": []},
                     {"role": "rollout-1", "flavor": "l4x1", "args": ["--worker-id", "run-w1", "--seed", "1"]},
                     {"role": "supervisor", "flavor": "cpu-basic", "args": []}]}
    assert costs.plan_flavors(plan) == {"train": "a10g-small", "rollout-run-w1": "l4x1"}

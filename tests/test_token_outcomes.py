"""Where every generated token went (lib/proxy/token_outcomes.py): on a real run of proxy, worker and trainer, the
outcomes replayed from the proxy's journal add up to the tokens the worker counted, and each is checked against a
counter the proxy or the trainer kept on its own; report.py prints the table and the run's dollars."""
import json
import os
import subprocess
import sys

import uuid

import pytest

import costs
import report
from conftest import ROOT, stop
from proxyproc import spawn  # noqa: F401 - a fixture
from runlib import tiny_loop
from test_proxy import group, publish
from test_proxy_access import as_, create, leased, own
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


def completions(n: int, equal: bool = False) -> list[dict]:
    """Four completions of n sampled tokens each (so a group's size tells it apart): rewards 0, 1, 0, 1, or all 1."""
    return [{"token_ids": [5 + j for j in range(n)], "logprobs": [-0.5 - i * 1e-3] * n,
             "reward": 1.0 if equal else float(i % 2), "finish_reason": "stop"} for i in range(4)]


def test_every_outcome_a_group_can_have_is_told_from_the_journal(bucket, spawn):
    """A real proxy, driven as participants, the run's own worker and a trainer would: one group meets each fate the
    journal can tell, of a size of its own (4 completions of n tokens), and the replay gives each its outcome, per
    version and per participant; the proxy's own counters agree on the groups dropped stale and held out."""
    p = spawn("--quarantine-after", "1", "--max-staleness", "1")
    publish(bucket, p, 1)
    alice, bob = as_(p, create(p, "alice")), as_(p, create(p, "bob"))
    trainer = as_(p, create(p, "lab", "trainer"))
    size = {"A1": 1, "A2": 2, "B1": 3, "B2": 4, "R1": 5, "L1": 6, "N2": 7, "S1": 8}  # tokens per completion
    gid = {k: uuid.uuid4().hex for k in size}

    def send(client, k, version, participant=True, equal=False):
        g = group(version=version, gid=gid[k], completions=completions(size[k], equal))
        g = own({**g, **leased(client)[0]}) if participant else g
        r = client.post("/v1/groups", json=g)
        assert r.status_code == 200, r.text
        return r.json()["status"]
    for client, k, equal in ((alice, "A1", False), (alice, "A2", True), (bob, "B1", False), (bob, "B2", False)):
        assert send(client, k, 1, equal=equal) == "accepted"
    got = trainer.post("/v1/batches/lease", json={"num_groups": 3}).json()
    assert [g["group_id"] for g in got["groups"]] == [gid["A1"], gid["A2"], gid["B1"]]
    r = trainer.post(f"/v1/batches/{got['batch_id']}/audit", json={  # B1 fails: bob is suspended, B2 held out
        "checked": [gid["A1"], gid["A2"], gid["B1"]], "failures": [{"group_id": gid["B1"], "check": "reward", "detail": "x"}]})
    assert r.json()["participants"]["bob"]["quarantined"], r.text
    assert p.http.post(f"/v1/batches/{got['batch_id']}/ack").status_code == 200
    assert send(p.http, "R1", 1, participant=False) == send(p.http, "L1", 1, participant=False) == "accepted"
    assert [g["group_id"] for g in trainer.post("/v1/batches/lease", json={"num_groups": 1}).json()["groups"]] == [gid["R1"]]
    publish(bucket, p, 2)
    assert send(p.http, "N2", 2, participant=False) == "accepted"
    publish(bucket, p, 3)                                                # L1 (version 1) is now too stale: dropped
    assert send(p.http, "S1", 1, participant=False) == "stale"           # and S1 is refused on arrival

    led = token_outcomes.replay(bucket, max_staleness=1)
    acc = token_outcomes.tally(led, skip_zero_std=True, generated_by_workers=None)
    want = {"trained": ["A1"], "skipped_zero_std": ["A2"], "left_out_by_audit": ["B1"], "quarantined": ["B2"],
            "leased_not_acked": ["R1"], "dropped_stale": ["L1", "S1"], "never_leased": ["N2"]}
    assert acc["tokens"] == {k: 4 * sum(size[g] for g in want.get(k, [])) for k in token_outcomes.OUTCOMES}
    assert acc["groups"] == {k: len(want.get(k, [])) for k in token_outcomes.OUTCOMES}
    assert acc["generated"] == acc["journal_tokens"] == 4 * sum(size.values()) and acc["refused_without_size"] == 0
    assert acc["by_version"][2] == {**dict.fromkeys(token_outcomes.OUTCOMES, 0), "never_leased": 4 * size["N2"]}
    assert {p_: {k: n for k, n in row.items() if n} for p_, row in acc["by_participant"].items()} == {
        "alice": {"trained": 4, "skipped_zero_std": 8}, "bob": {"left_out_by_audit": 12, "quarantined": 16},
        token_outcomes.RUN: {"leased_not_acked": 20, "dropped_stale": 24 + 32, "never_leased": 28}}
    s = p.stats()  # the live proxy's own counters, as its metrics row logs them
    assert (s["groups_dropped_stale"], s["groups_held_out"], s["groups_acked"]) == (2, 1, 3)
    checks = token_outcomes.cross_checks(acc, led, [], [{f"proxy/{k}": s[k] for k in (
        "groups_dropped_stale", "groups_acked", "groups_held_out")}])
    assert [c["what"] for c in checks[-3:] if c["ok"]] == [
        "groups dropped stale = proxy's groups_dropped_stale", "groups in acked batches = proxy's groups_acked",
        "groups held out = proxy's groups_held_out"], checks

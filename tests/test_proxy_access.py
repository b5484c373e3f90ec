"""Scoped tokens and contributors without bucket keys, against the real proxy process, the real S3 server
and (last) a real rollout worker and trainer: what each role may call, that every group records the
participant whose token sent it, rate limits and revocation that need no restart and survive one, the
launcher's token commands, and adapter files fetched through presigned URLs or the proxy."""
import hashlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

import common

import proxy_client
from conftest import ROOT, stop
from proxyproc import spawn, wait_for  # noqa: F401 - spawn is a fixture
from test_proxy import group, publish


def as_(p, token: str) -> httpx.Client:
    """A client of `token`, speaking this code's protocol as ProxyClient does (GET /v1/whoami needs it)."""
    return httpx.Client(base_url=p.url, headers={"X-Proxy-Token": token, "X-Protocol": str(common.PROTOCOL)},
                        timeout=30)


def open_dataset(p, dataset: str = "prompts", size: int = 1000) -> None:
    """The run's owner opens a dataset, as a trainer opens its task's at its start: participants lease only those."""
    r = p.http.post("/v1/prompts/datasets", json={"dataset": dataset, "size": size})
    assert r.status_code == 200, r.text


def create(p, name: str, role: str = "worker", max_rps: float = 0.0, workers: int | None = None) -> str:
    """A participant's token, in a run whose owner opened the tests' dataset ("prompts", 1000 prompts: `leased`'s);
    workers: the live workers its share counts at most (the proxy's default when None)."""
    open_dataset(p)
    r = p.http.post("/v1/tokens", json={"name": name, "role": role, "max_rps": max_rps,
                                        **({"workers": workers} if workers is not None else {})})
    assert r.status_code == 200, r.text
    return r.json()["token"]


def leased(client: httpx.Client, n: int = 1, dataset: str = "prompts", size: int = 1000) -> list[dict]:
    """n prompts leased by `client`'s token, each as the fields a group answering it names (docs/trust.md)."""
    got = client.post("/v1/prompts/lease", json={"dataset": dataset, "size": size, "n": n})
    assert got.status_code == 200, got.text
    return [{"lease_id": got.json()["lease_id"], "prompt_index": i} for i in got.json()["indices"]]


_NTH = itertools.count(1)


def own(g: dict) -> dict:
    """`g` with completions no other group has (test_proxy.group's are all alike): the proxy refuses a
    participant's group whose completions, tokens and logprobs, are those of another (a replay)."""
    k = next(_NTH)
    for c in g["completions"]:
        c["logprobs"] = [x - k * 1e-6 for x in c["logprobs"]]
    return g


def own_group(client: httpx.Client, **over) -> dict:
    """A group as a participant's worker sends one: answering a prompt its token leased, completions its own."""
    return own(group(**{**leased(client)[0], **over}))


def test_each_role_may_call_what_its_scope_allows(bucket, spawn):
    p = spawn()
    publish(bucket, p, 1)
    worker, trainer = as_(p, create(p, "alice")), as_(p, create(p, "lab-1", "trainer"))
    assert worker.post("/v1/groups", json=own_group(worker, version=1)).json()["status"] == "accepted"
    assert worker.post("/v1/prompts/lease", json={"dataset": "prompts", "size": 1000, "n": 2}).status_code == 200
    assert worker.get("/v1/adapters/latest").json()["version"] == 1
    assert worker.get("/v1/adapters/1/files").status_code == 200
    assert worker.get("/v1/whoami").json() | {"run_id": None} == {
        "protocol": common.PROTOCOL, "participant": "alice", "role": "worker", "max_rps": 0.0, "run_id": None,
        "group_size": 4, "max_staleness": common.MAX_STALENESS}
    lease = trainer.post("/v1/batches/lease", json={"num_groups": 1}).json()
    for method, path, body in [("POST", "/v1/batches/lease", {"num_groups": 1}),
                               ("POST", f"/v1/batches/{lease['batch_id']}/renew", None),
                               ("POST", f"/v1/batches/{lease['batch_id']}/release", None),
                               ("POST", f"/v1/batches/{lease['batch_id']}/ack", None),
                               ("POST", "/v1/adapters", {"version": 2, "step": 2, "published_at": 1.0}),
                               ("GET", "/v1/stats", None), ("GET", "/metrics", None),
                               ("POST", "/v1/tokens", {"name": "mallory"}), ("GET", "/v1/tokens", None)]:
        r = worker.request(method, path, json=body)
        assert r.status_code == 403 and "needs a" in r.text, (path, r.status_code, r.text)
    assert trainer.post(f"/v1/batches/{lease['batch_id']}/renew").status_code == 200
    assert trainer.post(f"/v1/batches/{lease['batch_id']}/ack").json() == {"acked": 1}
    assert trainer.get("/v1/stats").status_code == 200 and trainer.get("/metrics").status_code == 200
    for method, path in [("POST", "/v1/tokens"), ("GET", "/v1/tokens"), ("DELETE", "/v1/tokens/alice")]:
        assert trainer.request(method, path, json={"name": "x"} if method == "POST" else None).status_code == 403
    # the role is checked before the body is read: a worker's 8 MB chunked body to a trainer route is not read
    s = socket.create_connection(("127.0.0.1", p.port))
    s.sendall(f"POST /v1/batches/lease HTTP/1.1\r\nHost: x\r\nX-Proxy-Token: {worker.headers['x-proxy-token']}\r\n"
              "Transfer-Encoding: chunked\r\n\r\n100000\r\n".encode() + b"x" * 1000)
    s.settimeout(30)
    assert s.recv(4096).startswith(b"HTTP/1.1 403")
    s.close()


def test_every_group_records_its_participant(bucket, spawn):
    p = spawn()
    alice, bob = as_(p, create(p, "alice")), as_(p, create(p, "bob"))
    mine = [own(group(worker=w, **lease)) for w, lease in zip(["gpu-0", "gpu-1"], leased(alice, 2))]
    for g in mine:
        assert alice.post("/v1/groups", json=g).json()["status"] == "accepted"
    assert bob.post("/v1/groups", json=own_group(bob, worker="gpu-0")).json()["status"] == "accepted"
    assert p.http.post("/v1/groups", json=group(worker="w1")).json()["status"] == "accepted"  # the run's own job
    # a participant cannot say who sent a group: the field is the proxy's to write
    forged = alice.post("/v1/groups", json={**group(), "participant": "bob"})
    assert forged.status_code == 422 and "participant" in forged.text
    got = p.http.post("/v1/batches/lease", json={"num_groups": 4}).json()["groups"]
    assert [g.get("participant") for g in got] == ["alice", "alice", "bob", None]
    assert {k: v for k, v in got[0].items() if k not in ("participant", "prompt_dataset")} == mine[0]  # otherwise as sent
    assert got[0]["prompt_dataset"] == "prompts"  # the proxy's record of the lease it answers (for the trainer's audit)
    s = p.stats()
    assert {n: d["groups"] for n, d in s["participants"].items()} == {"admin": 1, "alice": 2, "bob": 1}
    assert {w: d["groups"] for w, d in s["workers"].items()} == {"alice/gpu-0": 1, "alice/gpu-1": 1, "bob/gpu-0": 1, "w1": 1}
    lines = [x for k in bucket.list("rollouts/") for x in bucket.get(k)[0].splitlines() if x.startswith(b'{"group_id"')]
    assert sum(x.endswith(b',"participant":"alice"}') for x in lines) == 2
    # kill -9: the journal says who sent what
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.wait()
    assert {n: d["groups"] for n, d in spawn().stats()["participants"].items()} == {"admin": 1, "alice": 2, "bob": 1}


def test_rate_limits_and_revocation_apply_at_once_and_survive_a_restart(bucket, spawn, run_name):
    p = spawn()
    token = create(p, "bob", max_rps=2)
    bob = as_(p, token)
    # as fast as it can until the limit answers (a loaded machine is slower, not 2 requests/s slow), bounded
    codes, t0 = [], time.monotonic()
    while not any(r.status_code == 429 for r in codes):
        assert len(codes) < 200, "200 requests in a row and no 429 from a 2 requests/s limit"
        codes.append(bob.get("/v1/adapters/latest"))
    passed, elapsed = sum(r.status_code == 200 for r in codes), time.monotonic() - t0
    assert passed <= 4 + 2 * elapsed + 1, (passed, elapsed)  # a burst of twice the rate, then the rate
    limited = [r for r in codes if r.status_code == 429]
    assert limited and all(int(r.headers["Retry-After"]) >= 1 and "2 requests/s" in r.text for r in limited)
    assert p.http.patch("/v1/tokens/bob", json={"max_rps": 0}).json()["max_rps"] == 0
    assert all(bob.get("/v1/adapters/latest").status_code == 200 for _ in range(12))
    assert p.http.patch("/v1/tokens/bob", json={"max_rps": 5}).status_code == 200
    # the bucket keeps the hash, never the token
    stored = json.loads(bucket.get("access/tokens.json")[0])
    assert token not in json.dumps(stored) and stored["tokens"]["bob"]["sha256"] == hashlib.sha256(token.encode()).hexdigest()
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.wait()
    q = spawn(token=p.token)
    bob = as_(q, token)
    assert bob.get("/v1/whoami").json()["max_rps"] == 5
    assert q.http.delete("/v1/tokens/bob").json()["revoked_at"]
    r = bob.get("/v1/adapters/latest")
    assert r.status_code == 401 and "revoked" in r.text
    assert q.http.post("/v1/tokens", json={"name": "bob"}).status_code == 409  # names are never reused
    os.kill(q.proc.pid, signal.SIGKILL)
    q.proc.wait()
    assert as_(spawn(token=p.token), token).get("/v1/adapters/latest").status_code == 401


def test_only_the_admin_token_changes_participants(bucket, spawn):
    """PATCH /v1/tokens/{name} (a rate limit) with a worker, trainer or inference token, on another
    participant and on itself, to lift a limit or to set one: a clear 403 each time, and nothing changes:
    not the table the admin lists, not its copy in the bucket, not the limit the participant is held to.
    Creating and revoking likewise. The same PATCH with the admin token works: the 403s are about roles."""
    p = spawn()
    bob_token = create(p, "bob", max_rps=5)
    callers = {role: as_(p, create(p, f"as-{role}", role)) for role in ("worker", "trainer", "inference")}
    listed = lambda: p.http.get("/v1/tokens").json()  # noqa: E731
    before, stored = listed(), bucket.get("access/tokens.json")[0]
    for role, c in callers.items():
        for name in ("bob", f"as-{role}"):  # another's limit, and its own
            for body in ({"max_rps": 0}, {"max_rps": 10_000}):
                r = c.patch(f"/v1/tokens/{name}", json=body)
                assert r.status_code == 403 and f"({role}) may not call PATCH" in r.text and "needs a admin token" in r.text, \
                    (role, name, r.status_code, r.text)
        for method, path, body in [("DELETE", "/v1/tokens/bob", None),
                                   ("POST", "/v1/tokens", {"name": f"by-{role}", "role": "admin"})]:
            r = c.request(method, path, json=body)
            assert r.status_code == 403 and "needs a admin token" in r.text, (role, method, r.status_code, r.text)
    assert listed() == before and bucket.get("access/tokens.json")[0] == stored
    assert as_(p, bob_token).get("/v1/whoami").json()["max_rps"] == 5
    r = p.http.patch("/v1/tokens/bob", json={"max_rps": 0})
    assert r.status_code == 200 and r.json()["max_rps"] == 0
    assert as_(p, bob_token).get("/v1/whoami").json()["max_rps"] == 0 and listed() != before


def test_launcher_creates_limits_lists_and_revokes_tokens(spawn):
    p = spawn()
    env = {**os.environ, "PROXY_TOKEN": p.token}
    run = lambda *a: subprocess.run(["bash", str(ROOT / "launch_jobs.sh"), *a, "--proxy-url", p.url], env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    out = run("--token-create", "carol", "--role", "worker", "--max-rps", "50")
    assert out.returncode == 0, out.stderr
    token = next(line.strip() for line in out.stdout.splitlines() if line.strip().startswith("agrpo_"))
    assert "carol (worker, 50 requests/s, 1 worker(s))" in out.stdout
    carol = as_(p, token)
    open_dataset(p)  # (the run's trainer opens its task's dataset; `own_group` leases a prompt of it)
    assert carol.post("/v1/groups", json=own_group(carol)).json()["status"] == "accepted"
    assert run("--token-limit", "carol", "--max-rps", "0").returncode == 0
    out = run("--token-limit", "carol", "--token-workers", "3")  # the rate limit left as it is
    assert out.returncode == 0 and "carol: no rate limit, 3 worker(s)" in out.stdout, out.stdout + out.stderr
    assert p.http.get("/v1/tokens").json()["tokens"][0]["workers"] == 3
    out = run("--token-limit", "carol")
    assert out.returncode != 0 and "--max-rps R and/or --token-workers N" in out.stderr, out.stderr
    listed = run("--token-list")
    assert "carol" in listed.stdout and "no rate limit, 3 worker(s)" in listed.stdout and "active" in listed.stdout
    assert run("--token-revoke", "carol").returncode == 0
    assert carol.post("/v1/groups", json=group()).status_code == 401
    bad = run("--token-create", "Not A Name")
    assert bad.returncode != 0 and "422" in bad.stderr


@pytest.mark.parametrize("mode", ["presigned", "proxy"])
def test_a_worker_token_fetches_verified_adapters_without_bucket_keys(bucket, spawn, tmp_path, mode):
    p = spawn("--adapter-urls", "auto" if mode == "presigned" else "proxy")
    publish(bucket, p, 1)
    client = proxy_client.ProxyClient(p.url, create(p, "dana"))
    listing = client.get("/v1/adapters/1/files")
    assert listing["via"] == mode and set(listing["files"]) == {"meta.json", *common.ADAPTER_FILES}
    url = listing["files"]["adapter_model.safetensors"]["url"]
    assert ("X-Amz-Signature=" in url) if mode == "presigned" else (url == "/v1/adapters/1/files/adapter_model.safetensors")
    again = client.get("/v1/adapters/1/files")  # signed once, handed out again while half their lifetime is left
    assert again["files"] == listing["files"]
    assert (450 <= again["expires_in_s"] <= listing["expires_in_s"] <= 900) if mode == "presigned" else again["expires_in_s"] is None
    meta = proxy_client.fetch_adapter_via_proxy(client, 1, tmp_path / "v1")
    assert meta["version"] == 1
    for name, digest in meta["files"].items():
        assert hashlib.sha256((tmp_path / "v1" / name).read_bytes()).hexdigest() == digest
    # a corrupt file is refused, named, and not left in place
    key = "adapters/v000001/adapter_model.safetensors"
    bucket.put(key, bucket.get(key)[0] + b"!")
    with pytest.raises(common.AdapterError, match="adapter_model.safetensors sha256"):
        proxy_client.fetch_adapter_via_proxy(client, 1, tmp_path / "v1-again")
    assert not (tmp_path / "v1-again" / "adapter_model.safetensors").exists()
    assert client.http.get("/v1/adapters/7/files").status_code == 404
    assert client.http.get("/v1/adapters/1/files/secrets.txt").status_code == 422


def file_downloads(p, at_least: int = 0) -> int:
    """Adapter files the proxy has streamed (--adapter-urls proxy): /metrics counts each request by its route.
    A request is counted once its handler returns, which can be just after the client has the last byte (CI met
    it: 2 where 3 had been downloaded), so this waits up to 5 s for at_least, then 0.2 s more for any beyond."""
    def count() -> int:
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in p.http.get("/metrics").text.splitlines()
                       if line.startswith("proxy_request_seconds_count{") and 'route="/v1/adapters/{version}/files/{name}"' in line))
    wait_for(lambda: count() >= at_least, timeout=5, msg=f"{at_least} adapter file downloads counted")
    time.sleep(0.2 if at_least else 0)
    return count()


def test_a_version_costs_a_worker_one_download_when_only_the_weights_change(bucket, spawn, tmp_path):
    """The listing carries meta.json as the proxy checked it at registration, and adapter_config.json (the same
    in every version) is written from what the worker already verified: one file downloaded a version."""
    p = spawn("--adapter-urls", "proxy")
    publish(bucket, p, 1)
    client = proxy_client.ProxyClient(p.url, create(p, "fay"))
    listing = client.get("/v1/adapters/1/files")
    assert listing["meta"] == bucket.get_json("adapters/v000001/meta.json")
    known, before = common.KnownFiles(), file_downloads(p)
    proxy_client.fetch_adapter_via_proxy(client, 1, tmp_path / "v1", known)
    assert file_downloads(p, before + 2) - before == 2  # the weights and the config; meta.json came with the listing
    publish(bucket, p, 2)
    meta = proxy_client.fetch_adapter_via_proxy(client, 2, tmp_path / "v2", known)
    assert file_downloads(p, before + 3) - before == 3  # the weights alone
    for name, digest in meta["files"].items():
        assert hashlib.sha256((tmp_path / "v2" / name).read_bytes()).hexdigest() == digest
    proxy_client.fetch_adapter_via_proxy(client, 2, tmp_path / "v2-afresh")
    assert file_downloads(p, before + 5) - before == 5  # with nothing known, both again


def test_a_presigned_url_that_fails_falls_back_to_the_proxy(bucket, spawn, tmp_path):
    p = spawn("--adapter-urls", "presigned")
    publish(bucket, p, 1)
    client = proxy_client.ProxyClient(p.url, create(p, "erin"))
    entry = {"url": "http://127.0.0.1:9/expired", "path": "/v1/adapters/1/files/meta.json"}  # nothing listens on :9
    assert json.loads(proxy_client._download(client, entry, None, "meta.json"))["version"] == 1
    with pytest.raises(common.AdapterError, match="presigned URL: ConnectError; proxy: HTTP 404"):
        proxy_client._download(client, {**entry, "path": "/v1/adapters/9/files/meta.json"}, None, "x")


@pytest.mark.timeout(900)  # its own bounds (train 600 s, the worker's exit 120 s) fire first, with the logs
def test_a_rollout_worker_with_only_a_url_and_a_worker_token_joins_the_run(tiny_model, spawn, bucket, run_name, tmp_path):
    """The worker's environment has no bucket, no bucket keys and no S3 endpoint: its adapters come through
    the proxy, its groups reach the trainer recorded as the participant's, its metrics stay on its disk."""
    p = spawn("--max-buffer", "4", "--max-staleness", "1")
    token = create(p, "guest")
    worker_env = {k: v for k, v in os.environ.items()
                  if k not in ("BUCKET", "S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RUN_NAME")}
    worker_env.update(PROXY_TOKEN=token, OMP_NUM_THREADS="1", SPOOL_DIR=str(tmp_path / "spool"))
    log = open(tmp_path / "rollout.log", "w")
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--proxy-url", p.url, "--model", tiny_model,
                               "--group-size", "4", "--prompts-per-round", "2", "--max-new-tokens", "6",
                               "--worker-id", "laptop"], env=worker_env, stdout=log, stderr=log)
    try:
        train = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", tiny_model, "--max-steps", "4",
                                "--batch-groups", "2", "--lr", "1e-3", "--lease-wait-s", "5", "--no-skip-zero-std"],
                               env={**os.environ, "RUN_NAME": run_name, "PROXY_URL": p.url, "PROXY_TOKEN": p.token,
                                    "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
        assert train.returncode == 0, train.stderr[-3000:]
        worker.wait(timeout=120)  # exits by itself after the final version
    finally:
        stop(worker)
    text = (tmp_path / "rollout.log").read_text()
    assert worker.returncode == 0, text[-3000:]
    rows = [json.loads(x) for x in bucket.get("metrics/train.jsonl")[0].decode().splitlines()]
    assert any(v >= 1 for r in rows for v in r["sample/policy_versions"]), "no group from a fetched adapter"
    stats = p.stats()
    assert stats["participants"]["guest"]["groups"] >= 8 and set(stats["workers"]) == {"guest/laptop"}
    # its groups were audited (docs/trust.md) and none failed: an honest worker is not flagged by numerical noise
    audited = [r for r in rows if "audit/groups" in r]
    assert sum(r["audit/groups"] for r in audited) >= 8 and not any(r["audit/failed"] for r in audited), audited
    assert stats["participants"]["guest"]["checks"]["failed"] == 0 and not stats["quarantined"]
    run_dir = next((tmp_path / "spool").iterdir())
    assert run_dir.name.startswith("run-") and run_name not in run_dir.name
    local = [json.loads(x) for x in (run_dir / "laptop" / "metrics.jsonl").read_text().splitlines()]
    assert any("perf/weight_sync_s" in r for r in local) and all(r["perf/weight_sync_s"] >= 0 for r in local
                                                                  if "perf/weight_sync_s" in r)
    assert not bucket.list("metrics/rollout-")  # nothing of the worker's in the bucket but its groups

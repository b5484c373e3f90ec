"""Runs that outlive their jobs: the proxy's address found through the bucket, the Jobs emulator
(tests/jobs_emulator.py) behaving like the platform, and the supervisor keeping a real run alive on it.

Everything below huggingface_hub is the emulator: jobs are real local processes (proxy.py,
rollout.py, train.py on the tiny model) talking to a real moto S3 server; the launcher and the
supervisor are this repository's code, submitting through `HfApi.run_uv_job`.
"""
from __future__ import annotations

import http.server
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi

import common

import proxy_client
from hf_jobs import JobSpec, load_launch, save_launch
from jobs_emulator import JobsEmulator
from supervisor import Policy, Supervisor

import launch_hf

TOKENS = {"HF_TOKEN": "hf_FAKEtoken0123456789", "PROXY_TOKEN": "proxy-secret-0123456789"}


def wait_for(pred, timeout: float, what: str, every: float = 0.3):
    t0 = time.time()
    while time.time() - t0 < timeout:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(what)


@pytest.fixture
def emulator(tmp_path, monkeypatch, s3_env):
    for k, v in TOKENS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PROXY_URL", raising=False)
    monkeypatch.setattr(launch_hf, "POLL_S", 0.5)
    emu = JobsEmulator(tmp_path / "jobs").install(monkeypatch)
    yield emu
    emu.close()


# --- the proxy's address through the bucket -----------------------------------------------------


def test_a_client_finds_a_relaunched_proxy_at_its_new_url(start_proxy, bucket, run_name, monkeypatch):
    """ProxyClient reads proxy/endpoint.json when PROXY_URL is unset, and again when its URL stops
    answering; PROXY_URL, when set, overrides the record."""
    monkeypatch.setenv("RUN_NAME", run_name)
    monkeypatch.delenv("PROXY_URL", raising=False)
    first = start_proxy()
    proxy_client.write_proxy_endpoint(bucket, first.url, job_id="job-1", incarnation=0, written_by="test")
    client = proxy_client.ProxyClient("http://127.0.0.1:9", first.token)   # the built-in default: nothing there
    assert str(client.http.base_url).rstrip("/") == first.url           # the record won at construction
    assert "buffer_size" in client.get("/v1/stats")

    first.proc.kill()
    first.proc.wait()
    second = start_proxy()   # a new port, as a relaunched job gets a new URL (and here a new token)
    client.http.headers["X-Proxy-Token"] = second.token
    proxy_client.write_proxy_endpoint(bucket, second.url, job_id="job-2", incarnation=1, written_by="test")
    assert "buffer_size" in client.get("/v1/stats")  # the retry looked again; only the second knows this token
    assert str(client.http.base_url).rstrip("/") == second.url

    # a URL that answers, but not as the run's proxy (the Jobs gateway of a job that is gone): a 404 makes
    # the client look again before it gives up
    gone = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gone)
    threading.Thread(target=gone.serve_forever, daemon=True).start()
    client.http.base_url = f"http://127.0.0.1:{gone.server_port}"
    assert "buffer_size" in client.get("/v1/stats") and str(client.http.base_url).rstrip("/") == second.url
    gone.shutdown()

    monkeypatch.setenv("PROXY_URL", first.url)   # set: no lookups, the record is ignored
    pinned = proxy_client.ProxyClient(first.url, second.token, patience_s=5.0)
    assert pinned.resolve is None and str(pinned.http.base_url).rstrip("/") == first.url
    with pytest.raises(httpx.TransportError):
        pinned.get("/v1/stats")


def watch(run_name: str, *policy: str) -> int:
    """`bash launch_jobs.sh --watch RUN` in this process: the supervisor's exit code."""
    try:
        launch_hf.main(["--watch", run_name, *policy])
        return 0
    except SystemExit as e:
        return e.code


def watch_in_thread(run_name: str, *policy: str) -> tuple[threading.Thread, dict]:
    """watch() in a daemon thread, started; its exit code lands in the dict as "code"."""
    result: dict = {}
    watcher = threading.Thread(target=lambda: result.update(code=watch(run_name, *policy)), daemon=True)
    watcher.start()
    return watcher, result


class Gone(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(404)
        self.end_headers()
        self.wfile.write(b"no such job")

    def log_message(self, *a):
        pass


# --- the emulator behaves like the platform -------------------------------------------------------


PROBE = '''
import http.server, json, os, sys, time
here = os.path.dirname(sys.argv[0])
json.dump({"argv": sys.argv, "env": {k: os.environ.get(k) for k in ("JOB_ID", "SECRET_X", "PLAIN", "HOME")},
           "files": sorted(os.listdir(here))}, open(os.path.join(here, "probe.json"), "w"))
if "--port" in sys.argv:
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    http.server.HTTPServer((sys.argv[sys.argv.index("--host") + 1], int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
time.sleep(float(sys.argv[-1]))
'''


def test_the_emulator_runs_each_job_as_a_process_with_the_platforms_rules(emulator, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "data file.txt").write_text("shipped")
    api = HfApi()

    def run(*args, timeout="30s", expose=None):
        return api.run_uv_job(str(tmp_path / "probe.py"), script_args=[str(tmp_path / "data file.txt"), *args],
                              env={"PLAIN": "1"}, secrets={"SECRET_X": "s3cr3t"}, timeout=timeout, expose=expose,
                              labels={"t": "probe"}, dependencies=["ninja"], namespace="alice")

    a = run("--host", "0.0.0.0", "--port", "8000", "60", expose=[8000])
    b = run("--host", "0.0.0.0", "--port", "8000", "60", expose=[8000])
    urls = [wait_for(lambda j=j: api.inspect_job(job_id=j.id, namespace="alice").status.expose_urls, 30, "url")[0]
            for j in (a, b)]
    assert urls[0] != urls[1]                                   # a new URL at every launch
    for u in urls:
        assert wait_for(lambda u=u: _get(u), 30, "probe answers") == "ok"
    probe = json.loads((emulator.jobs[a.id].folder / "probe.json").read_text())
    folder = str(emulator.jobs[a.id].folder)
    # the shipped files in the job's own folder (a space in a name becomes '_', as huggingface_hub uploads
    # it), /data/ in the command rewritten to that folder, `uv run --with` replaced by this python
    assert probe["files"] == ["data_file.txt", "home", "job.log", "probe.py"]
    assert probe["argv"][:2] == [f"{folder}/probe.py", f"{folder}/data_file.txt"]
    assert probe["env"] == {"JOB_ID": a.id, "SECRET_X": "s3cr3t", "PLAIN": "1", "HOME": f"{folder}/home"}

    c = run("60", timeout="2s")                                # the timeout is enforced
    info = wait_for(lambda: (i := api.inspect_job(job_id=c.id, namespace="alice")).status.stage == "ERROR" and i,
                    60, "timeout")
    assert info.status.message == "Job timeout exceeded" and emulator.jobs[c.id].proc.poll() is not None
    assert emulator.jobs[c.id].finished - emulator.jobs[c.id].started < 30

    api.cancel_job(job_id=a.id, namespace="alice")
    assert api.inspect_job(job_id=a.id, namespace="alice").status.stage == "CANCELED"
    assert _get(urls[0]) is None                               # its process is gone
    emulator.crash(b.id)                                       # a crash / OOM kill
    assert api.inspect_job(job_id=b.id, namespace="alice").status.message == "killed by signal 9"
    listed = {j.id: j.status.stage for j in api.list_jobs(labels={"t": "probe"}, namespace="alice")}
    assert listed == {a.id: "CANCELED", b.id: "ERROR", c.id: "ERROR"}


def _get(url: str) -> str | None:
    try:
        return httpx.get(url + "/health", timeout=2).text
    except httpx.HTTPError:
        return None


# --- the supervisor's rules ----------------------------------------------------------------------


def test_one_supervisor_per_run(bucket, run_name, tmp_path):
    def sup(me: str) -> Supervisor:
        s = Supervisor(None, bucket, run_name, "alice", "t", Policy(poll_s=1), tmp_path / me)
        s.me = me
        return s
    a, b = sup("here-1"), sup("there-2")
    a.take_lease()
    # (the heartbeat's age: seconds, whatever a loaded machine makes of the two bucket calls in between)
    with pytest.raises(SystemExit, match=rf"run {run_name} is already supervised by here-1 \(heartbeat \d+ s ago\)"):
        b.take_lease()
    a.release()
    b.take_lease()                       # a released lease is free at once
    assert a.etag is not None and not a.heartbeat()   # a's next heartbeat finds it taken: a stops


def test_a_supervisor_job_hands_over_before_its_timeout(emulator, bucket, run_name, tmp_path, monkeypatch):
    """Running as a job whose timeout is near: it starts its successor from the plan, hands it the lease, exits."""
    (tmp_path / "idle.py").write_text("import time; time.sleep(120)\n")
    spec = JobSpec("supervisor", "idle.py", [], [], "cpu-basic", [], {}, timeout="1h")
    save_launch(bucket, {"run": run_name}, [spec], {"idle.py": tmp_path / "idle.py"})
    monkeypatch.setenv("JOB_ID", "old-supervisor-job")
    sup = Supervisor(HfApi(), bucket, run_name, "alice", TOKENS["HF_TOKEN"], Policy(poll_s=0.2, handover_s=3599.5),
                     tmp_path / "work")
    assert sup.run_forever() == 0
    (succ,) = emulator.by_role("supervisor")
    lease = bucket.get_json("launch/supervisor.json")
    assert lease["owner"] == succ.id and lease["handed_over_by"] == "old-supervisor-job" and succ.stage()[0] == "RUNNING"
    nxt = Supervisor(HfApi(), bucket, run_name, "alice", "t", Policy(poll_s=1), tmp_path / "next")
    nxt.me = succ.id
    nxt.take_lease()                     # the successor owns it at once; anyone else would be refused


def test_a_role_that_crash_loops_is_given_up_and_said_so(emulator, bucket, run_name, tmp_path, capsys):
    """A trainer whose job exits at once (status 2) is relaunched after 1 s, then 2 s, then given up; without
    a trainer the run cannot go on, so the supervisor exits 1. `--cancel` then stops the rest, and a later
    supervisor relaunches nothing."""
    emu = emulator
    (tmp_path / "fails.py").write_text("import sys; print('bad flag: --no-such-flag', file=sys.stderr); sys.exit(2)\n")
    (tmp_path / "idle.py").write_text("import time; time.sleep(300)\n")
    specs = [JobSpec("trainer", "fails.py", [], ["--max-steps", "5"], "cpu-basic", [], {}, timeout="30m"),
             JobSpec("rollout-1", "idle.py", [], [], "cpu-basic", [], {}, timeout="30m")]
    save_launch(bucket, {"run": run_name}, specs, {n: tmp_path / n for n in ("fails.py", "idle.py")})
    api = HfApi()
    for spec in specs:   # what the launcher would have started
        api.run_uv_job(str(tmp_path / spec.script), script_args=spec.args, timeout=spec.timeout, namespace="alice",
                       labels={"async-grpo-run": run_name, "role": spec.role})
    policy = ["--policy.poll-s", "0.5", "--policy.backoff-s", "1", "--policy.crash-limit", "3",
              "--policy.min-uptime-s", "300"]
    watcher, result = watch_in_thread(run_name, *policy)
    watcher.join(180)
    out = capsys.readouterr().out
    assert not watcher.is_alive() and result["code"] == 1, out
    t = emu.by_role("trainer")
    assert len(t) == 3 and all(j.stage() == ("ERROR", "exit code 2") for j in t)
    assert "bad flag" in emu.text(t[2])
    # backoff: 1 s after the first crash, 2 s after the second
    assert t[1].started - t[0].finished >= 1 and t[2].started - t[1].finished >= 2
    assert "relaunching in 1 s (crash 1 in a row)" in out and "relaunching in 2 s (crash 2 in a row)" in out
    assert re.search(rf"trainer: job {t[2].id} ended \(ERROR: exit code 2\) after \d+ s\. GIVING UP on trainer: its last "
                     rf"3 jobs each ended within 300 s of starting \(a crash loop\)\. See `hf jobs logs {t[2].id}`", out)
    assert "proxy" not in out.replace(run_name, "")   # the plan has no proxy: nothing said or done about one
    assert "cannot go on without trainer: exiting" in out
    (w,) = emu.by_role("rollout-1")
    assert w.stage()[0] == "RUNNING"     # the rest keeps running until --cancel, which a later supervisor respects
    launch_hf.main(["--cancel", run_name])
    assert w.stage()[0] == "CANCELED" and "recorded the stop" in capsys.readouterr().out
    assert watch(run_name, *policy) == 0 and "was stopped by --cancel" in capsys.readouterr().out
    assert len(emu.jobs) == 4            # nothing was relaunched after the stop


# --- a real run on emulated Jobs: the proxy crashes, a worker times out, the supervisor relaunches ---


STEPS = 24


def trainer_steps(emu: JobsEmulator) -> list[int]:
    text = "".join(emu.text(j) for j in emu.by_role("trainer"))
    return [int(m) for m in re.findall(r"^step\s+(\d+) ", text.replace("\r", "\n"), re.M)]


@pytest.mark.timeout(900)  # ~1 min on a quiet machine; its own waits add up to far more
def test_a_run_on_emulated_jobs_survives_a_proxy_crash_and_a_worker_timeout(emulator, tiny_model, run_name, capsys):
    emu, bucket = emulator, common.Bucket(run=run_name)
    launch_hf.main(["--run", run_name, "--workers", "2", "--steps", str(STEPS), "--model", tiny_model,
                    "--task", "addition", "--group-size", "4", "--max-new-tokens", "6", "--timeout", "30m",
                    "--no-supervise", "--proxy-arg=--max-buffer", "--proxy-arg=8",
                    "--rollout-arg=--prompts-per-round", "--rollout-arg=2",
                    "--train-arg=--batch-groups", "--train-arg=2", "--train-arg=--lr", "--train-arg=1e-3",
                    "--train-arg=--lease-wait-s", "--train-arg=5", "--train-arg=--no-skip-zero-std",
                    "--train-arg=--checkpoint-every", "--train-arg=4"])
    (proxy1,) = emu.by_role("proxy")
    record = proxy_client.read_proxy_endpoint(bucket)
    assert record["job_id"] == proxy1.id and record["url"] == f"http://127.0.0.1:{proxy1.ports[8000]}"
    # the record's incarnation is the real proxy's own (its /v1/stats, as its log says at start): the first
    assert record["incarnation"] == 0 and "proxy: incarnation 0," in emu.text(proxy1), record
    for r in ("rollout-1", "rollout-2", "trainer"):   # nobody is told the proxy's URL: they read the record
        assert "PROXY_URL" not in emu.by_role(r)[0].spec["environment"]

    watcher, result = watch_in_thread(run_name, "--policy.poll-s", "1", "--policy.backoff-s", "1",
                                      "--policy.proxy-wait-s", "180", "--policy.drain-s", "180")
    try:
        # 1. the proxy's job crashes a few steps in; the supervisor relaunches it at a new URL
        wait_for(lambda: len(trainer_steps(emu)) >= 3, 300, "three trainer steps", every=1)
        emu.crash(proxy1.id)
        t_kill = time.time()
        proxy2 = wait_for(lambda: len(emu.by_role("proxy")) == 2 and emu.by_role("proxy")[1], 120, "proxy relaunch")
        wait_for(lambda: (proxy_client.read_proxy_endpoint(bucket) or {}).get("job_id") == proxy2.id, 180, "new record")
        t_recorded = time.time()
        # 2. meanwhile a worker's job reaches its timeout; the supervisor relaunches it. The trainer is
        # frozen until then (SIGSTOP; its leases last 300 s): on a fast machine it ran the remaining 21
        # steps in the 4 s the supervisor took to see the expiry, and a finished run relaunches nobody
        (trainer,) = emu.by_role("trainer")
        emu.pause(trainer.id)
        n = len(trainer_steps(emu))
        assert n < STEPS, "the run ended before the worker expired: raise STEPS"
        (w1,) = emu.by_role("rollout-1")
        emu.expire(w1.id)
        try:
            w1b = wait_for(lambda: len(emu.by_role("rollout-1")) == 2 and emu.by_role("rollout-1")[1], 120,
                           "worker relaunch")
        finally:
            emu.resume(trainer.id)
        wait_for(lambda: len(trainer_steps(emu)) > n, 300, "a trainer step with the new proxy", every=0.5)
        # 3. the run finishes by itself; the supervisor stops the proxy and exits
        watcher.join(600)
        assert not watcher.is_alive(), "the supervisor did not finish"
    finally:
        out = capsys.readouterr().out
        print(out)
    assert result["code"] == 0, out
    url1, url2 = (f"http://127.0.0.1:{p.ports[8000]}" for p in (proxy1, proxy2))
    record = proxy_client.read_proxy_endpoint(bucket)
    assert url1 != url2 and record["url"] == url2
    # the relaunched proxy read the first one's journal and fenced it off: incarnation 1, from its own
    # state (its log) through /v1/stats into the record the supervisor wrote, and the supervisor's line
    assert record["incarnation"] == 1 and "proxy: incarnation 1," in emu.text(proxy2), record
    assert f"proxy answers at {url2} (job {proxy2.id}, incarnation 1)" in out
    assert f"relaunched proxy: job {proxy2.id}" in out and f"relaunched rollout-1: job {w1b.id}" in out
    assert re.search(rf"rollout-1: job {w1.id} ended \(ERROR: Job timeout exceeded\)", out)
    assert re.search(rf"proxy: job {proxy1.id} ended \(ERROR: killed by signal 9\)", out)
    assert f"cancelled proxy job {proxy2.id} (the run is over)" in out
    # every job ended; the ones that were not stopped by the platform ended cleanly by themselves
    stages = {j.id: j.stage()[0] for j in emu.jobs.values()}
    assert all(s in ("COMPLETED", "ERROR", "CANCELED") for s in stages.values())
    # the trainer rode out the proxy's absence. Today that holds while the relaunch takes less than the
    # ~22 s of retries proxy_client.ProxyClient makes before a call fails (measured here: ~10 s from the kill to
    # the new URL in the bucket); with a client that waits out outages of any length it holds at any load
    assert stages[trainer.id] == "COMPLETED" and stages[w1b.id] == "COMPLETED", stages
    assert stages[emu.by_role("rollout-2")[0].id] == "COMPLETED"
    # the trainer and the surviving worker found the new proxy through the bucket, the new worker at start
    for job in (trainer, emu.by_role("rollout-2")[0], w1b):
        assert f"proxy: now at {url2}" in emu.text(job), job.spec["labels"]
    print("\nJOBS-EMULATION", json.dumps({"proxy_kill_to_new_url_recorded_s": round(t_recorded - t_kill, 1)}))

    # the run reached its last step; versions contiguous, each verifiable; no acked group twice; nothing lost
    rows = [json.loads(x) for x in bucket.get("metrics/train.jsonl")[0].decode().splitlines()]
    assert rows[-1]["step"] == STEPS
    metas = sorted((bucket.get_json(k) for k in bucket.list("adapters/") if k.endswith("meta.json")),
                   key=lambda m: m["version"])
    assert [m["version"] for m in metas] == list(range(1, len(metas) + 1))
    assert bucket.get_json("adapters/latest.json")["version"] == metas[-1]["version"]
    for m in metas:
        for name, digest in m["files"].items():
            assert common.hashlib.sha256(bucket.get(f"adapters/v{m['version']:06d}/{name}")[0]).hexdigest() == digest
    journal = [json.loads(line) for k in sorted(bucket.list("rollouts/")) for line in bucket.get(k)[0].splitlines()]
    events = [e for e in journal if "t" in e]
    leases = {e["batch_id"]: e["group_ids"] for e in events if e["t"] == "lease"}
    acked = [g for e in events if e["t"] == "ack" for g in leases[e["batch_id"]]]
    assert len(acked) == len(set(acked)) == 2 * STEPS   # one trainer, never restarted: every batch acked once
    accepted = {e["group_id"] for e in journal if "group_id" in e}
    for w in ("w1", "w2"):
        answered = {g: st for x in bucket.get(f"metrics/rollout-{run_name}-{w}.jsonl")[0].decode().splitlines()
                    for g, st in json.loads(x).get("group_status", {}).items()}
        held = {g for g, st in answered.items() if st in ("accepted", "duplicate")}
        assert held, f"{w}: the proxy acknowledged none of its groups: nothing to check against the log"
        assert held <= accepted and "refused" not in answered.values(), w


# --- a standby proxy job: the proxies lead among themselves, the supervisor keeps two of them -----------------------


def health_role(job) -> str | None:
    try:
        return httpx.get(f"http://127.0.0.1:{job.ports[8000]}/health", timeout=5).json().get("role")
    except (httpx.HTTPError, ValueError):
        return None


def led_by(bucket, job, timeout: float) -> dict:
    """Wait until proxy/endpoint.json names `job`, written by that proxy itself (it took the lead), and /health agrees."""
    url = f"http://127.0.0.1:{job.ports[8000]}"
    return wait_for(lambda: (r := proxy_client.read_proxy_endpoint(bucket) or {}).get("url") == url
                    and r["written_by"].startswith("proxy incarnation") and health_role(job) == "leader" and r,
                    timeout, f"job {job.id} leads")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_standby_proxy_job_leads_when_the_proxy_ends_and_the_supervisor_keeps_a_standby(
        emulator, bucket, run_name, tiny_model, tmp_path, capsys):
    """The launcher's --standby layout (its two proxy jobs only, --term-s 2 for speed): the proxy leads, the standby
    stands by. Its job killed, the standby leads and writes proxy/endpoint.json itself (the URL the supervisor left
    it); the supervisor relaunches the dead job as a standby and never records a standby's URL. Then that leader
    hangs (SIGSTOP): the relaunched standby leads, and the supervisor cancels the job that stopped answering and
    relaunches it as a standby. `--cancel` ends it."""
    emu, api = emulator, HfApi()
    args = launch_hf.with_preset(launch_hf.Args(run=run_name, model=tiny_model, task="addition", standby=True,
                                                 timeout="30m", proxy_arg=["--term-s", "2"]))
    specs = [s for s in launch_hf.plan(args, "alice") if s.role in ("proxy", "proxy-standby")]
    assert [s.role for s in specs] == ["proxy", "proxy-standby"] and specs[1].args == [*specs[0].args, "--standby"]
    save_launch(bucket, {"run": run_name}, specs, launch_hf.sources(args))
    load_launch(bucket, tmp_path / "work")   # as launch() does: the jobs run the bucket's copy
    launch_hf.start_jobs(api, args, "alice", TOKENS["HF_TOKEN"], bucket, specs, tmp_path / "work")
    (leader,), (standby,) = emu.by_role("proxy"), emu.by_role("proxy-standby")
    assert proxy_client.read_proxy_endpoint(bucket)["job_id"] == leader.id   # the launcher recorded the first leader

    watcher, result = watch_in_thread(run_name, "--policy.poll-s", "0.5", "--policy.backoff-s", "0.5",
                                      "--policy.proxy-wait-s", "10")
    took_over, seen = [], []

    def said(line: str) -> bool:  # in the supervisor's output so far (read from capsys and kept)
        seen.append(capsys.readouterr().out)
        return line in "".join(seen)
    try:
        for role, stop in (("proxy", emu.crash), ("proxy-standby", emu.pause)):   # the leader's role, and its end
            other = "proxy-standby" if role == "proxy" else "proxy"   # the standby's role
            # the supervisor's own look must have found it standing by (a relaunch slow to start on a loaded machine
            # can be seen "not answering" until it leads) before its leader is stopped
            wait_for(lambda s=standby, o=other: health_role(s) == "standby" and proxy_client.read_job_url(bucket, s.id)
                     and said(f"{o}: job {s.id} at http://127.0.0.1:{s.ports[8000]}: standby"),
                     120, "the supervisor saw the standby and left it its URL")
            stop(leader.id)
            led_by(bucket, standby, 60)
            # the supervisor's look, which can lag a loaded machine's takeover, sees it lead before it is stopped next
            wait_for(lambda s=standby, o=other: said(f"{o}: job {s.id} at http://127.0.0.1:{s.ports[8000]}: leader"), 60,
                     "the supervisor saw the new leader")
            took_over.append(standby)
            relaunched = wait_for(lambda r=role: len(emu.by_role(r)) == 2 and emu.by_role(r)[-1], 90, "a relaunch")
            assert "--standby" in relaunched.spec["command"] and relaunched.id not in (leader.id, standby.id)
            leader, standby = standby, relaunched
        wait_for(lambda: health_role(standby) == "standby", 120, "the second relaunch stands by")
        time.sleep(2)   # a few of the supervisor's looks at a standing-by job
        assert proxy_client.read_proxy_endpoint(bucket)["job_id"] == leader.id
        launch_hf.main(["--cancel", run_name])
        watcher.join(60)
    finally:
        out = "".join(seen) + capsys.readouterr().out
        print(out)
    assert result.get("code") == 0, out
    assert "recorded the leader" not in out   # each leader wrote its own record; a standby's URL never went there
    for job, role in zip(took_over, ("proxy-standby", "proxy")):   # the supervisor told each leader from a standby
        url = f"http://127.0.0.1:{job.ports[8000]}"
        assert f"{role}: job {job.id} at {url}: standby" in out and f"{role}: job {job.id} at {url}: leader" in out, out
    assert re.search(r"relaunched proxy: job \w+ on \S+ as a standby", out), out
    assert re.search(r"relaunched proxy-standby: job \w+ on \S+ as a standby", out), out
    hung = emu.by_role("proxy-standby")[0]
    assert re.search(rf"proxy-standby: job {hung.id} has not answered /health for \d+ s: cancelling it", out), out
    assert hung.stage()[0] == "CANCELED"


# --- a trainer of several ranks (a flavor with several GPUs), its job killed --------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_trainer_job_of_two_ranks_killed_is_relaunched_and_resumes(emulator, tiny_model, run_name, capsys):
    """`--trainer-flavor h200x2`: the trainer's job runs train.py under torchrun, one rank per GPU of the flavor (here
    two CPU ranks, gloo: the emulator has no GPUs). Its job killed mid-run (SIGKILL to every process of it, as an
    evicted job), the supervisor relaunches it; the new job's two ranks resume from the last checkpoint and finish the
    run, its versions contiguous."""
    emu, bucket = emulator, common.Bucket(run=run_name)
    steps = 40
    launch_hf.main(["--run", run_name, "--workers", "1", "--steps", str(steps), "--model", tiny_model,
                    "--task", "addition", "--group-size", "4", "--max-new-tokens", "6", "--timeout", "30m",
                    "--trainer-flavor", "h200x2", "--no-supervise", "--rollout-arg=--prompts-per-round",
                    "--rollout-arg=2", "--train-arg=--batch-groups", "--train-arg=2", "--train-arg=--lr",
                    "--train-arg=1e-3", "--train-arg=--lease-wait-s", "--train-arg=5", "--train-arg=--no-skip-zero-std",
                    "--train-arg=--checkpoint-every", "--train-arg=2"])
    (trainer,) = emu.by_role("trainer")
    assert "--nproc-per-node" in trainer.spec["command"] and trainer.spec["flavor"] == "h200x2", trainer.spec
    watcher, result = watch_in_thread(run_name, "--policy.poll-s", "1", "--policy.backoff-s", "1",
                                      "--policy.min-uptime-s", "5", "--policy.drain-s", "180")
    try:
        # killed once a checkpoint is in the bucket, the one the relaunch must resume from
        at = wait_for(lambda: (c := bucket.get_json("checkpoints/latest.json")) and c["step"] >= 2 and c["step"], 300,
                      "a checkpoint of two ranks", every=0.2)
        emu.crash(trainer.id)
        assert at < steps, "the run ended before the kill: raise steps"
        trainer2 = wait_for(lambda: len(emu.by_role("trainer")) == 2 and emu.by_role("trainer")[1], 120,
                            "trainer relaunch")
        watcher.join(420)
        assert not watcher.is_alive(), "the supervisor did not finish"
    finally:
        out = capsys.readouterr().out
        print(out)
    assert result["code"] == 0, out
    assert re.search(rf"trainer: job {trainer.id} ended \(ERROR: killed by signal 9\)", out), out
    assert f"relaunched trainer: job {trainer2.id}" in out
    second = emu.text(trainer2)
    assert "resumed from checkpoint step" in second and re.search(rf"^step\s+{steps} ", second.replace("\r", "\n"), re.M)
    assert emu.by_role("trainer")[1].stage()[0] == "COMPLETED"
    metas = sorted(bucket.get_json(k)["version"] for k in bucket.list("adapters/") if k.endswith("meta.json"))
    assert metas == list(range(1, len(metas) + 1)) and bucket.get_json("adapters/latest.json")["step"] == steps

"""Resilience of the adapter path and the rollout side: the spool keeps finished groups across a
proxy outage and a worker restart; adapters that do not fit, or do not verify, are never loaded;
a publisher killed at any moment never leaves latest.json on an incomplete version."""
import json
import os
import re
import threading

import pytest

import adapter_sync
import common

import proxy_client
import rollout
from test_proxy import group


def test_spool_survives_proxy_outage_and_resubmits_idempotently(start_proxy, tmp_path):
    said = []
    spool = rollout.Spool(str(tmp_path), "run1", "w1", said.append)
    groups = [group() for _ in range(3)]
    for g in groups:
        spool.add(g)
    down = proxy_client.ProxyClient("http://127.0.0.1:9", "t", patience_s=0)  # nothing listens there; don't wait
    assert spool.flush(down) == [] and len(spool.pending()) == 3
    assert "proxy unreachable" in said[-1]

    proxy = start_proxy("--group-size", "4")
    up = proxy_client.ProxyClient(proxy.url, proxy.token)
    spool.add(groups[0])  # the same group again (a worker restarted mid-send): idempotent
    assert sorted(spool.flush(up)) == sorted((g["group_id"], "accepted") for g in groups)
    assert spool.pending() == [] and proxy.stats()["groups_accepted"] == 3

    bad = group(G=3)  # wrong group size: the proxy refuses it; it is kept aside, not retried forever
    spool.add(bad)
    assert spool.flush(up) == [(bad["group_id"], "refused")]
    assert os.listdir(tmp_path / "run1" / "w1" / "refused") == [f"{bad['group_id']}.json"]
    assert json.loads((tmp_path / "run1" / "w1" / "refused" / f"{bad['group_id']}.json").read_text()) == bad


def journal_commits(p) -> int:
    return int(next(float(line.rsplit(" ", 1)[1]) for line in p.http.get("/metrics").text.splitlines()
                    if line.startswith("proxy_journal_commit_seconds_count")))


def test_a_round_is_sent_at_once(start_proxy, tmp_path):
    """A round's groups go to the proxy at once, so they share its journal writes: sent one by one (as before),
    each of the 8 waited for a write of its own, 8 writes. And 429s that several threads wait out together
    count once in `backpressure_s`."""
    proxy = start_proxy("--group-size", "4")
    spool = rollout.Spool(str(tmp_path), "run1", "w1", print)
    groups = [group() for _ in range(8)]
    for g in groups:
        spool.add(g)
    before = journal_commits(proxy)
    assert sorted(spool.flush(proxy_client.ProxyClient(proxy.url, proxy.token))) == sorted(
        (g["group_id"], "accepted") for g in groups)
    commits = journal_commits(proxy) - before
    # the first alone, then seven together: typically 2-3 writes (6 on a loaded machine); one by one, 8
    assert 1 <= commits < len(groups), commits
    assert spool.pending() == [] and proxy.stats()["groups_accepted"] == 8

    client = proxy_client.ProxyClient(proxy.url, proxy.token)
    waits = [threading.Thread(target=client._count_wait, args=(1.0,)) for _ in range(8)]
    for t in waits:
        t.start()
    for t in waits:
        t.join()
    assert 1.0 <= client.backpressure_s < 1.5, client.backpressure_s


def test_adapter_that_does_not_fit_is_refused():
    names = {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp"}
    fits = lambda meta: adapter_sync.check_fits(meta, "m", 16, names)  # noqa: E731 - model "m", rank at most 16
    fits({"base_model": "m", "lora": {"r": 16, "target_modules": ["q_proj", "v_proj"]}})
    fits({"base_model": "m", "lora": {"r": 16, "target_modules": sorted(names)}})  # "all-linear": the full paths
    with pytest.raises(common.AdapterError, match="rank 32 above the limit 16"):
        fits({"base_model": "m", "lora": {"r": 32, "target_modules": ["q_proj"]}})
    with pytest.raises(common.AdapterError, match=r"target modules \['wq'\] do not exist"):
        fits({"base_model": "m", "lora": {"r": 8, "target_modules": ["q_proj", "wq"]}})
    with pytest.raises(common.AdapterError, match="trained on 'other'"):
        fits({"base_model": "other", "lora": {"r": 8, "target_modules": ["q_proj"]}})


def test_a_worker_that_cannot_load_the_latest_version_asks_at_its_own_and_waits_when_told_why(tmp_path, caplog):
    """rollout.Worker against stand-ins of its engine, proxy and sync thread. Once it refused the newest version,
    each paced prompt request names the version it holds and why; told that nothing generated with that version
    can be trained (`why`), it says so once and waits for a newer version, answering routed requests meanwhile. A
    grant counted at a newer version it then cannot have is not generated, and the next request says why."""
    import logging
    from types import SimpleNamespace

    caplog.set_level(logging.INFO, logger="rollout")
    asked, served = [], []
    answers = [{"indices": [], "epochs": [], "version": 2, "done": False, "retry_s": 1.0, "why": "version 1 is too old"},
               {"indices": [], "epochs": [], "version": 2, "done": False, "retry_s": 1.0, "why": "version 1 is too old"},
               {"indices": [7], "epochs": [0], "lease_id": "l1", "version": 3, "done": False}]

    def refuse(new: dict) -> None:
        raise common.AdapterError("it has rank 8")

    def post(path: str, body: dict) -> dict:
        asked.append(body)
        if answers[0]["version"] == 3:  # v3 fails to verify while the worker waits for it
            sync.failed, sync.why_failed = 3, "version 3 not loaded: sha256 mismatch"
        return answers.pop(0)
    engine = SimpleNamespace(tok=None, eos=set(), swap_in=refuse, chat=lambda reqs: [{"text": ""} for _ in reqs])
    client = SimpleNamespace(post=post)
    new = {"version": 2, "dir": str(tmp_path / "v2"), "published": None, "ready": 0.0}
    sync = SimpleNamespace(latest=2, seen=2, failed=0, why_failed="", max_staleness=3, done=False, ready=new,
                           take=lambda: (sync.ready, setattr(sync, "ready", None))[0])
    routed = SimpleNamespace(serve=lambda chat, version, wait_s=0.0: served.append(wait_s) or 0)
    worker = rollout.Worker(rollout.resolved(rollout.Args()), engine, client, sync, None, None, routed, threading.Event(),
                            SimpleNamespace(name="addition", prompts=list(range(10))))
    worker.version = 1
    worker.take_new()
    assert worker.version == 1 and worker.refused[0] == 2
    assert worker.ask_for_prompts() is None and worker.waits()  # told why: it waits, serving meanwhile
    assert asked[-1]["version"] == 1 and asked[-1]["refused"].startswith("refused version 2: it has rank 8")
    assert worker.ask_for_prompts() is None and worker.waits() and served[-1] == 0.5
    assert [r.message for r in caplog.records].count("not generating with version 1: version 1 is too old") == 1
    sync.latest = 3  # a newer version: asked for at the latest (it refused none that new), granted at v3 ...
    assert not worker.waits()
    assert worker.ask_for_prompts() is None and "version" not in asked[-1]  # ... which it cannot have: not generated
    answers.append({"indices": [], "epochs": [], "version": 3, "done": False, "retry_s": 1.0})
    assert worker.ask_for_prompts() is None
    assert asked[-1]["version"] == 1 and asked[-1]["refused"] == "version 3 not loaded: sha256 mismatch"


@pytest.mark.timeout(600)  # its own bound is 240 s, on top of the model and the proxy
@pytest.mark.parametrize("pace", [False, True], ids=["unpaced", "paced"])
def test_worker_keeps_previous_version_when_handed_a_corrupt_adapter(tiny_model, start_proxy, bucket, run_name,
                                                                     tmp_path, pace):
    """The worker serves v1; v2 arrives with one flipped byte: it keeps generating with v1 and says why. Paced (the
    proxy's default), once v2 failed to verify it asks for its grants at v1 (refused: why), so the proxy counts its
    rounds at the version that generates them; a grant counted at v2 before it knew is not generated, and it never
    waits long for v2. --max-staleness 3: v1's rounds stay trainable while the stand-in trainer (runlib) leases
    without registering versions."""
    import time

    import train
    from runlib import worker_refuses_v2
    proxy = start_proxy("--group-size", "4", "--max-staleness", "3", *([] if pace else ["--no-pace"]))
    model, _ = train.build_model(train.Args(model=tiny_model, lora_r=4, lora_alpha=8))

    def publish(v: int, corrupt: bool = False) -> None:
        # weights of its own: bytes the worker verified before under the same sha256 are not fetched again
        next(p for n, p in model.named_parameters() if "lora_B" in n).data += 0.01 * v
        model.save_pretrained(tmp_path / f"v{v}")
        common.publish_adapter(bucket, tmp_path / f"v{v}", v, v, tiny_model)
        if corrupt:  # flip one byte of the weights after their sha256 went into meta.json
            key = f"adapters/v{v:06d}/adapter_model.safetensors"
            data = bytearray(bucket.get(key)[0])
            data[len(data) // 2] ^= 0x01
            bucket.put(key, bytes(data))
        assert proxy.http.post("/v1/adapters", json={"version": v, "step": v, "published_at": time.time()}).is_success

    publish(1)
    text, after = worker_refuses_v2(tiny_model, proxy, run_name, tmp_path, lambda: publish(2, corrupt=True),
                                    "not loading version 2", rounds_after=6)
    assert re.search(r"not loading version 2: .*sha256", text), text[-2000:]
    assert len(after) >= 6 and set(after) == {"1"}  # it kept generating, with v1 only
    rows = [json.loads(x) for x in bucket.get("metrics/rollout-w1.jsonl")[0].decode().splitlines()]
    waits = [r["rollout/adapter_wait_s"] for r in rows if "rollout/adapter_wait_s" in r]
    assert max(waits, default=0.0) < 30, waits  # never for v2 once it had failed (the wait's bound is 60 s)
    if not pace:
        assert not waits  # no grant names a version
        return
    # the proxy's journal, in log order, from v2's registration on
    lines = [json.loads(x) for k in sorted(bucket.list("rollouts/")) for x in bucket.get(k)[0].splitlines()]
    since = lines[next(i for i, x in enumerate(lines) if x.get("t") == "version" and x["version"] == 2):]
    grants = [x["version"] for x in since if x.get("t") == "grant" and x["key"].endswith("w1")]
    released = [x for x in since if x.get("t") == "release" and x["key"].endswith("w1")]
    assert set(grants) <= {1, 2} and grants.count(1) >= 6, grants
    # a grant counted at v2 (asked for before v2 had failed) was given back unused by the next request
    assert grants.count(2) <= 2 and len(released) >= grants.count(2), (grants, released)
    assert {x["policy_version"] for x in since if "group_id" in x and "t" not in x} == {1}
    assert [r["version"] for r in rows if "rollout/gen_s" in r][-len(after):] == [1] * len(after)  # so do its rows


PUBLISHER = r'''
import json, os, pathlib, sys, time
sys.path.insert(0, sys.argv[1])
import common


class Logged(common.Bucket):
    """The real bucket, each write said as it begins and once it is done: the test reads where a kill landed."""

    def put(self, rel, data, **kw):
        print("begin", rel, flush=True)
        etag = super().put(rel, data, **kw)
        print("done", rel, flush=True)
        return etag


b = Logged(run=sys.argv[2])
d = pathlib.Path(sys.argv[3]); d.mkdir(exist_ok=True)
(d / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
latest = b.get_json("adapters/latest.json")
v = latest["version"] if latest else 0
t0 = time.time()
while time.time() - t0 < 300:  # the test kills it within seconds; bounded should it not
    v += 1
    (d / "adapter_model.safetensors").write_bytes(os.urandom(2_000_000))  # 2 MB: uploads take a while
    common.publish_adapter(b, d, v, v, "m")
    print("published", v, flush=True)
sys.exit("publisher: not killed within 300 s")
'''


def where_killed(last: str) -> tuple[str, int | None]:
    """Where the publisher was when it died, from the last line it wrote: (what, the version it was writing)."""
    kind, _, rel = last.partition(" ")
    if rel.startswith("adapters/v"):
        version = int(rel.split("/v")[1][:6])
        return (f"uploading {rel}" if kind == "begin" else f"between writes, after {rel}"), version
    if kind == "begin" and rel == "adapters/latest.json":
        return "writing the pointer", None
    return "between versions", None


def test_killing_a_publisher_never_leaves_the_pointer_on_an_incomplete_version(bucket, run_name, tmp_path, seed):
    """kill -9 a process that keeps publishing adapter versions (common.publish_adapter, through a bucket
    that logs each write as it begins and ends), six times: at a random moment after it published a version,
    and, every other time, within moments of its starting to upload a version's weights. At least one kill
    must have landed mid-upload, by the publisher's own log; after each, adapters/latest.json names a
    version whose files all verify, and never the version that was being written."""
    import queue
    import random
    import signal
    import subprocess
    import sys
    import threading
    import time

    from conftest import ROOT
    script = tmp_path / "publisher.py"
    script.write_text(PUBLISHER)
    rng = random.Random(seed)
    where = []
    for k in range(6):
        err = tmp_path / f"publisher-{k}.err"
        p = subprocess.Popen([sys.executable, str(script), str(ROOT), run_name, str(tmp_path / "adapter")],
                             env=os.environ, stdout=subprocess.PIPE, stderr=open(err, "w"), text=True)
        lines: list[str] = []
        got: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [got.put(x.rstrip("\n")) for x in p.stdout], daemon=True)
        reader.start()

        def until(pred, what: str, timeout: float = 120) -> None:
            t0 = time.time()  # however slow its start on a loaded machine
            while time.time() - t0 < timeout:
                try:
                    lines.append(got.get(timeout=0.5))
                except queue.Empty:
                    assert p.poll() is None, f"the publisher exited ({p.returncode}): {err.read_text()[-2000:]}"
                    continue
                if pred(lines[-1]):
                    return
            raise AssertionError(f"the publisher never got to {what} within {timeout} s: {lines[-5:]}")

        try:
            until(lambda x: x.startswith("published "), "publishing a version")
            if k % 2:  # as it starts uploading the next version's weights, then a moment into that
                until(lambda x: x.startswith("begin adapters/v") and x.endswith("/adapter_model.safetensors"),
                      "uploading the next version's weights")
                time.sleep(rng.uniform(0, 0.02))
            else:      # at a random moment
                time.sleep(rng.uniform(0, 2.5))
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        reader.join(10)
        while not got.empty():
            lines.append(got.get())
        what, writing = where_killed(lines[-1])
        where.append(what)
        latest = bucket.get_json("adapters/latest.json")
        assert latest is not None
        common.fetch_adapter(bucket, latest["version"], tmp_path / f"check-{latest['version']}")  # verifies sha256
        if writing is not None:  # killed while writing version N's files or meta.json: the pointer is still on N-1
            assert latest["version"] == writing - 1, (what, latest)
    print("\nwhere each kill landed:", where)
    assert [w for w in where if w.startswith("uploading adapters/v")], f"no kill landed mid-upload: {where}"
    versions = sorted(int(k.split("/v")[1][:6]) for k in bucket.list("adapters/v") if k.endswith("meta.json"))
    assert versions == list(range(1, len(versions) + 1))  # a killed publisher's successor never reused a number


def test_spool_sets_aside_unreadable_files_and_sweeps_stale_temp_files(start_proxy, tmp_path):
    """What a power cut can leave: a file cut short, a temp file of a write in progress. The cut file
    is moved to unreadable/ with its name in the log and the rest goes on; old temp files go, a
    fresh one (a write in progress right now) stays."""
    d = tmp_path / "run1" / "w1"
    d.mkdir(parents=True)
    good = group()
    (d / f"{good['group_id']}.json").write_text(json.dumps(good))
    cut = json.dumps(group())[:57]
    (d / "0badc0ffee0badc0ffee.json").write_text(cut)
    (d / "latin1.json").write_bytes(b"\xff\xfe not utf-8")
    (d / ".old.tmp").write_text(cut)
    os.utime(d / ".old.tmp", (0, 0))
    (d / ".fresh.tmp").write_text(cut)
    said = []
    spool = rollout.Spool(str(tmp_path), "run1", "w1", said.append)
    assert sorted(p.name for p in d.glob(".*.tmp")) == [".fresh.tmp"]
    assert any("removed 1 stale temp file" in s for s in said), said
    proxy = start_proxy("--group-size", "4")
    assert spool.flush(proxy_client.ProxyClient(proxy.url, proxy.token)) == [(good["group_id"], "accepted")]
    assert sorted(os.listdir(d / "unreadable")) == ["0badc0ffee0badc0ffee.json", "latin1.json"]
    assert (d / "unreadable" / "0badc0ffee0badc0ffee.json").read_text() == cut  # kept as it was, for inspection
    for name, err in (("0badc0ffee0badc0ffee.json", "JSONDecodeError"), ("latin1.json", "UnicodeDecodeError")):
        assert any(f"spool file {d / name} is unreadable ({err}" in s for s in said), said
    assert spool.pending() == [] and proxy.stats()["groups_accepted"] == 1


FULL_DISK = r'''
import json, os, resource, signal, sys
sys.path[:0] = [sys.argv[5], os.path.join(sys.argv[5], "tests"), os.path.join(sys.argv[5], "tests", "support")]
import common, proxy_client, rollout
from test_proxy import group
root, mode, url, token = sys.argv[1:5]
said = []
spool = rollout.Spool(root, "run1", "w1", said.append)
early = [group() for _ in range(2)]
for g in early:
    spool.add(g)                       # on disk before it fills
if mode == "tmpfs":                    # fill the (small) disk
    try:
        with open(os.path.join(root, "filler"), "wb", buffering=0) as f:
            for _ in range(4096):      # 16 MB at most: far past the 256 kB disk
                f.write(b"\0" * 4096)
    except OSError:
        pass
else:                                  # no tmpfs here: the kernel refuses any file over 16 bytes instead
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))
late = [group() for _ in range(3)]
for g in late:
    spool.add(g)                       # the disk refuses: held in memory, said so
state = {"held": len(spool.held), "pending": len(spool.pending()),
         "tmp": [n for n in os.listdir(spool.dir) if n.endswith(".tmp")]}
statuses = spool.flush(proxy_client.ProxyClient(url, token))
print(json.dumps({"said": said, "before_flush": state, "statuses": statuses, "held": len(spool.held),
                  "pending": spool.pending(), "ids": [g["group_id"] for g in early + late]}))
'''


def _tmpfs_works(path) -> bool:
    import shutil
    import subprocess
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {path}"],
                          capture_output=True).returncode == 0


def test_spool_survives_a_full_disk(start_proxy, tmp_path):
    """The spool's disk fills up mid-run (a real tmpfs of 256 kB in a private mount namespace, or,
    where unprivileged namespaces are not allowed, a file size limit): what is on disk stays, new
    groups are held in memory and said so, and all of them reach the proxy; no temp file is left."""
    import subprocess
    import sys

    from conftest import ROOT
    proxy = start_proxy("--group-size", "4")
    root = tmp_path / "spool"
    root.mkdir()
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    args = [sys.executable, str(script), str(root), "MODE", proxy.url, proxy.token, str(ROOT)]
    if _tmpfs_works(root):
        mode, cmd = "tmpfs", ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=256k tmpfs "$0" && exec "$@"',
                              str(root), *[a.replace("MODE", "tmpfs") for a in args]]
    else:
        mode, cmd = "rlimit", [a.replace("MODE", "rlimit") for a in args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["before_flush"] == {"held": 3, "pending": 2, "tmp": []}, out
    reason = "No space left on device" if mode == "tmpfs" else "File too large"
    assert any("cannot write group" in s and reason in s and "held in memory" in s for s in out["said"]), out["said"]
    assert sorted(g for g, _ in out["statuses"]) == sorted(out["ids"]) and {s for _, s in out["statuses"]} == {"accepted"}
    assert out["held"] == 0 and out["pending"] == [] and proxy.stats()["groups_accepted"] == 5


SKEWED = r'''
import runpy, sys, time
_real = time.time
time.time = lambda: _real() + 3600.0  # this host's wall clock is an hour ahead of the trainer's
sys.argv = sys.argv[1:]
sys.path.insert(0, __import__("os").path.dirname(sys.argv[0]))  # as `python SCRIPT` would (run_path does not)
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.mark.timeout(600)  # its own bounds: 240 s for the rounds, 120 s for the exit
def test_worker_timings_do_not_depend_on_the_hosts_clocks(tiny_model, start_proxy, bucket, run_name, tmp_path):
    """A worker whose wall clock is an hour ahead: perf/weight_sync_s and rollout/version_lag_s still
    measure seconds (the proxy's age_s of the version against the worker's own monotonic clock)."""
    import re
    import subprocess
    import sys
    import time

    import train
    from conftest import ROOT, stop
    from runlib import stand_in_trainer
    proxy = start_proxy("--group-size", "4")
    (tmp_path / "skewed.py").write_text(SKEWED)
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token,
           "SPOOL_DIR": str(tmp_path / "spool"), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([sys.executable, str(tmp_path / "skewed.py"), str(ROOT / "rollout.py"), "--model", tiny_model,
                               "--group-size", "4", "--prompts-per-round", "1", "--max-new-tokens", "4",
                               "--worker-id", "w1", "--poll-s", "1"], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        with stand_in_trainer(proxy):  # paced: rounds are granted while a trainer takes what arrives
            t0 = time.time()
            while " round 1 v0" not in log.read_text():
                assert time.time() - t0 < 240 and worker.poll() is None, log.read_text()[-2000:]
                time.sleep(0.2)
            model, _ = train.build_model(train.Args(model=tiny_model, lora_r=4, lora_alpha=8))
            model.save_pretrained(tmp_path / "v1")
            common.publish_adapter(bucket, tmp_path / "v1", 1, 1, tiny_model)
            assert proxy.http.post("/v1/adapters", json={"version": 1, "step": 1,
                                                         "published_at": time.time()}).is_success
            while not re.search(r" round \d+ v1:", log.read_text()):
                assert time.time() - t0 < 240 and worker.poll() is None, log.read_text()[-2000:]
                time.sleep(0.2)
            worker.terminate()  # SIGTERM: the worker ends its round and uploads its metrics
            assert worker.wait(timeout=120) == 0, log.read_text()[-2000:]
    finally:
        stop(worker)
    rows = [json.loads(x) for x in bucket.get("metrics/rollout-w1.jsonl")[0].decode().splitlines()]
    sync = [r["perf/weight_sync_s"] for r in rows if "perf/weight_sync_s" in r]
    lag = [r["rollout/version_lag_s"] for r in rows if "rollout/version_lag_s" in r]
    assert len(sync) == 1 and 0 <= sync[0] < 120, rows
    assert len(lag) == 1 and sync[0] <= lag[0] < 240, rows
    assert rows[-1]["time"] > time.time() + 3000  # the worker's clock really was an hour ahead


def test_a_worker_deletes_the_adapter_versions_it_will_not_load_again(tmp_path, monkeypatch):
    monkeypatch.setattr(adapter_sync.tempfile, "tempdir", str(tmp_path))
    sync = adapter_sync.AdapterSync(None, None, model="m", worker_id="w1")
    for name in ("v000001", "v000002", "v000003", "v000005", "v1-notes"):
        os.makedirs(os.path.join(sync.workdir, name))
        open(os.path.join(sync.workdir, name, "adapter_model.safetensors"), "w").close()
    sync.prune(3)  # v3 in use, v5 downloaded: v1 and v2 will never be read again
    assert sorted(os.listdir(sync.workdir)) == ["v000003", "v000005", "v1-notes"]
    assert os.listdir(os.path.join(sync.workdir, "v000003")) == ["adapter_model.safetensors"]


def test_a_worker_that_stops_mid_download_ends_quietly_and_leaves_no_files(tmp_path, monkeypatch, caplog):
    """The worker stops (SIGTERM, the run's end) while its fetch thread is downloading a version, e.g. waiting
    through a bucket outage: close() removes the downloads folder, and the download that resumes later ends
    without a traceback instead of writing into the removed folder. Stand-in proxy answers: one version
    announced, its file listing held back until after close()."""
    import logging
    from types import SimpleNamespace
    caplog.set_level(logging.INFO, logger="rollout")
    monkeypatch.setattr(adapter_sync.tempfile, "tempdir", str(tmp_path))
    crashes, listing_asked, release = [], threading.Event(), threading.Event()
    monkeypatch.setattr(threading, "excepthook", lambda a: crashes.append(a.exc_value))

    def get(path: str, **params) -> dict:
        if path == "/v1/adapters/latest":
            if params["after"] >= 1:
                release.wait(5)
            return {"version": 1, "done": False, "max_staleness": 1, "age_s": 0.0}
        listing_asked.set()
        release.wait(5)  # the outage: answered only once the worker has stopped
        return {"files": {}, "meta": meta}
    meta = {"version": 1, "files": {name: f"{i:064x}" for i, name in enumerate(common.ADAPTER_FILES)},
            "lora": {"r": 8, "target_modules": ["q_proj"]}}
    sync = adapter_sync.AdapterSync(SimpleNamespace(get=get), None, model="m", worker_id="w1")
    for sha in meta["files"].values():  # every file held already: the download writes at once once answered
        sync.known.add(sha, b"{}")
    sync.start()
    assert listing_asked.wait(5)
    sync.close(wait_s=0.2)
    assert not os.path.exists(sync.workdir)
    release.set()
    sync.fetcher.join(5)
    assert not sync.fetcher.is_alive() and crashes == [] and not os.path.exists(sync.workdir)
    assert "not loading" not in caplog.text  # a stop is not a version that failed to verify

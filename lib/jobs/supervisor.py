"""The supervisor of a run on Hugging Face Jobs: keeps every role of the run's layout alive until the
trainer has published its final version, then stops what is left and exits.

    bash launch_jobs.sh --watch RUN             # here, in the foreground (Ctrl-C stops watching, not the run)
    bash launch_jobs.sh --watch RUN --detach    # as a small CPU job (role supervisor); `--run` starts one too

Every `poll_s` it lists the run's jobs by label (`async-grpo-run=RUN`), takes the newest job of each
role, and relaunches any role whose job ended (completed, error, timeout, out of memory, preempted,
cancelled by the platform: every terminal stage alike) before the run is done, the proxy first:
it waits until the new proxy answers /health at its new URL and writes that URL to the run's
`proxy/endpoint.json`, where the workers and the trainer find it (proxy_client.ProxyClient). A proxy job
started by someone else (by hand) is adopted the same way. The job specs come from the bucket
(`launch/plan.json` and `launch/files/`, written by the launcher), secrets from this process's
environment, so it can relaunch from the bucket alone.

Crash loops: a job that ends within `min_uptime_s` of starting is a crash. The k-th crash in a row
of a role waits backoff_s * 2^(k-1) (capped) before the relaunch; at `crash_limit` crashes in a row
the role is given up, said so, and if that leaves the run unable to go on (proxy, trainer, or every
rollout worker given up) the supervisor exits with status 1. A job that ran longer resets its count.

Done: `adapters/latest.json` has reached the trainer's `--max-steps` (the final version is in the
bucket), or the proxy's registry answers `done` (the trainer registered it as final). Then workers
and trainer get `drain_s` to exit by themselves, and whatever still runs (the proxy) is cancelled.

With a standby proxy job (a preset's `standby`: roles `proxy` and `proxy-standby`), either proxy job that ends is
relaunched as a standby (`--standby`: a start without it would depose the standby that leads now), without waiting
for it. Each look asks every running proxy job's /health which one leads: it leaves each job its exposed URL
(`proxy/urls/JOB_ID.json`), which the proxy that takes the lead writes to `proxy/endpoint.json` itself, within
seconds; the supervisor never records a standby there, and records the leader only when that record names
another URL (a takeover before the supervisor had seen the new leader's URL). A running proxy job whose /health
has not answered for `proxy_wait_s` (hung: the other one leads by then) is cancelled, and so relaunched.

One supervisor per run: `launch/supervisor.json` is a lease with a heartbeat (conditional writes); a
second one refuses to start while the first one's heartbeat is fresh. A supervisor running as a job
hands over to a successor job `handover_s` before its own timeout. `--cancel` writes `launch/stop.json`:
the supervisor then exits without relaunching anything.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from autoscale import Autoscaler
from common import BucketError, ConflictError
from proxy_client import read_job_url, read_proxy_endpoint, write_job_url
from hf_jobs import (LEASE, STANDBY, TERMINAL, JobSpec, exposed_url, final_step, hub_errors, identity, load_launch,
                     newest_by_role, proxy_role, record_proxy, role, run_jobs, secret_values, stage, stopped, submit,
                     timeout_seconds, wait_for_proxy)


@dataclass
class Policy:
    poll_s: float = 30.0
    """seconds between looks at the run's jobs"""
    min_uptime_s: float = 600.0
    """a job that ends sooner than this after it started counts as a crash"""
    crash_limit: int = 4
    """crashes in a row after which a role is given up"""
    backoff_s: float = 30.0
    """wait before relaunching after a first crash; doubles with each crash in a row"""
    backoff_max_s: float = 900.0
    """the longest wait before a relaunch"""
    proxy_wait_s: float = 900.0
    """how long a relaunched proxy may take to answer /health"""
    drain_s: float = 600.0
    """after the final version: how long workers and trainer get to exit before they are cancelled"""
    handover_s: float = 900.0
    """a supervisor job starts its successor this long before its own timeout"""


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} supervisor: {msg}", flush=True)


def uptime(job, launched: dict[str, float]) -> float:
    """Seconds the job ran: from its start (else our submission, else its creation) to its end (or now)."""
    if job.started_at:
        t0 = job.started_at.timestamp()
    else:
        t0 = launched.get(job.id) or (job.created_at.timestamp() if job.created_at else time.time())
    t1 = job.finished_at.timestamp() if getattr(job, "finished_at", None) else time.time()
    return max(0.0, t1 - t0)


class Supervisor:
    def __init__(self, api, bucket, run: str, namespace: str, token: str, policy: Policy, workdir: Path):
        self.api, self.bucket, self.run, self.ns, self.token, self.p = api, bucket, run, namespace, token, policy
        self.workdir, self.me, self.t_start = workdir, identity(), time.time()
        self.plan: dict = {}
        self.specs: dict[str, JobSpec] = {}
        self.crashes: dict[str, int] = {}
        self.next_at: dict[str, float] = {}
        self.given_up: set[str] = set()
        self.seen_ended: set[str] = set()
        self.launched: dict[str, float] = {}   # job id -> when we submitted it
        self.proxy_roles: dict[str, str] = {}  # proxy job id -> what its /health said at the last look
        self.deaf_since: dict[str, float] = {}  # running proxy job id -> since when its /health has not answered
        self.etag: str | None = None
        self.ttl = max(3 * policy.poll_s, 90.0)
        self.scaler: Autoscaler | None = None   # the plan asks for autoscaling (autoscale.py)

    # --- the loop ---------------------------------------------------------------------------

    def run_forever(self) -> int:
        self.load()
        self.take_lease()
        handed_over = False
        try:
            while True:
                code = self.step()
                if code is not None:
                    return code
                if not self.heartbeat():
                    return 1
                if self.handover_due():
                    handed_over = self.hand_over()
                    if handed_over:
                        return 0
                time.sleep(self.p.poll_s)
        finally:
            if not handed_over:
                self.release()

    def load(self) -> None:
        """The run's plan and files from the bucket (none: watch only), and the autoscaler where the plan asks for one."""
        loaded = load_launch(self.bucket, self.workdir)
        if loaded is None:
            log(f"no launch/plan.json in run {self.run}: watching only (recording a new proxy's URL); "
                "relaunching needs a run started by `bash launch_jobs.sh`")
            return
        self.plan, specs = loaded
        self.specs = {s.role: s for s in specs}
        if self.plan.get("autoscale"):
            self.scaler = Autoscaler.for_plan(self.bucket, self.run, self.plan, specs, self.p.drain_s)
        log(f"run {self.run}: {', '.join(s for s in self.specs if s != 'supervisor')}; "
            f"final step {self.final_step()}; polling every {self.p.poll_s:g} s"
            + (f"; autoscaling the rollout jobs ({self.scaler.bounds})" if self.scaler else ""))

    def step(self) -> int | None:
        """One look at the run; an exit status when the supervisor is finished, else None. The Hub or
        the bucket failing for a while (after their own retries) is waited out: a run lasts days."""
        try:
            return self.look()
        except (SystemExit, BucketError) as e:
            if isinstance(e, SystemExit) and not isinstance(e.code, str):
                raise
            log(f"{e}; looking again in {self.p.poll_s:g} s")
            return None

    def look(self) -> int | None:
        if stop := stopped(self.bucket, self.plan or None):
            log(f"run {self.run} was stopped by --cancel ({stop.get('by', '?')}): not relaunching anything")
            return 0
        with hub_errors("listing the run's jobs"):
            current = newest_by_role(run_jobs(self.api, self.run, self.ns))
        if self.done():
            return self.finish()
        if self.scaler is not None:   # the fleet's rollout roles into self.specs (retired ones out: not relaunched)
            self.scaler.look(self, current, log)
        proxies = ["proxy", STANDBY] if self.standby() else ["proxy"]
        roles = proxies + [r for r in self.specs if r not in (*proxies, "supervisor")]
        for r in roles:
            self.tend(r, current.get(r))
        fatal = (["proxy"] if set(proxies) <= self.given_up else []) + (["trainer"] if "trainer" in self.given_up else [])
        workers = [r for r in self.specs if r.startswith("rollout-")]
        if workers and set(workers) <= self.given_up:
            fatal.append("every rollout worker")
        if fatal:
            log(f"run {self.run} cannot go on without {' and '.join(fatal)}: exiting (the other jobs keep "
                f"running; `bash launch_jobs.sh --cancel {self.run}` stops them)")
            return 1
        return None

    def tend(self, r: str, job) -> None:
        """Keep role `r` alive: note its job's end, relaunch it when its backoff has passed."""
        if r in self.given_up:
            return
        if job is not None and stage(job) not in TERMINAL:
            if r in ("proxy", STANDBY) and stage(job) == "RUNNING":
                self.see_proxy(job) if self.standby() else self.ensure_recorded(job)
            return
        if r not in self.specs:   # no plan for it (a run not started by the launcher): nothing to relaunch
            return
        now = time.time()
        if job is not None and job.id not in self.seen_ended:
            self.seen_ended.add(job.id)
            up = uptime(job, self.launched)
            self.crashes[r] = self.crashes.get(r, 0) + 1 if up < self.p.min_uptime_s else 0
            what = f"{r}: job {job.id} ended ({stage(job)}: {job.status.message or 'no message'}) after {up:.0f} s"
            if self.crashes[r] >= self.p.crash_limit:
                self.given_up.add(r)
                log(f"{what}. GIVING UP on {r}: its last {self.crashes[r]} jobs each ended within "
                    f"{self.p.min_uptime_s:g} s of starting (a crash loop). See `hf jobs logs {job.id}`; once fixed, "
                    f"run `bash launch_jobs.sh --watch {self.run}` again")
                return
            delay = min(self.p.backoff_s * 2 ** (self.crashes[r] - 1), self.p.backoff_max_s) if self.crashes[r] else 0.0
            self.next_at[r] = now + delay
            log(f"{what}; relaunching {f'in {delay:.0f} s (crash {self.crashes[r]} in a row)' if delay else 'now'}")
        elif job is None and r not in self.next_at:
            log(f"{r}: the run has no job for this role; launching one")
            self.next_at[r] = now
        if now >= self.next_at.get(r, now):
            self.relaunch(r)

    def standby(self) -> bool:
        """The run's layout has a standby proxy job: leadership is the proxies' own (proxy/leader.json)."""
        return STANDBY in self.specs

    def relaunch(self, r: str) -> None:
        spec = self.specs.get(r)
        if spec is None:
            return
        if r in ("proxy", STANDBY) and self.standby() and "--standby" not in spec.args:
            spec = replace(spec, args=[*spec.args, "--standby"])  # the other proxy leads now, or will
        try:
            with hub_errors(f"relaunching {r}"):
                job = submit(self.api, spec, self.run, self.ns, secret_values(self.token), self.workdir)
        except SystemExit as e:   # the Hub refused (credits, quota) or is down: try again after a backoff
            self.next_at[r] = time.time() + self.p.backoff_s
            log(f"{e}; trying again in {self.p.backoff_s:g} s")
            return
        self.launched[job.id] = time.time()
        self.next_at.pop(r, None)
        log(f"relaunched {r}: job {job.id} on {spec.flavor}{' as a standby' if '--standby' in spec.args else ''}")
        if r == "proxy" and not self.standby():
            self.ensure_recorded(job)

    def ensure_recorded(self, job) -> None:
        """Make `proxy/endpoint.json` point at this proxy job once it answers /health."""
        record = read_proxy_endpoint(self.bucket)
        if record and record.get("job_id") == job.id:
            return
        try:
            url = wait_for_proxy(self.api, job.id, self.ns, self.token, self.p.proxy_wait_s,
                                 min(5.0, self.p.poll_s), log=log)
        except RuntimeError as e:   # (the Hub failing meanwhile raises SystemExit: step() waits it out)
            log(f"{e}")
            if "did not answer" in str(e):   # running but deaf: stop it, the next look relaunches it
                with hub_errors(f"cancelling the proxy job {job.id}"):
                    self.api.cancel_job(job_id=job.id, namespace=self.ns)
            return
        rec = record_proxy(self.bucket, url, job.id, self.token, written_by=f"supervisor {self.me}")
        log(f"proxy answers at {url} (job {job.id}, incarnation {rec['incarnation']}); recorded in "
            f"proxy/endpoint.json for the workers and the trainer")

    def see_proxy(self, job) -> None:
        """With a standby: leave the running proxy job its URL, say when its role changes, and record it in
        proxy/endpoint.json only if it leads and that record names another URL. One /health, no waiting."""
        url = exposed_url(job)
        if url is None:
            return
        if read_job_url(self.bucket, job.id) != url:
            write_job_url(self.bucket, job.id, url, written_by=f"supervisor {self.me}")
        now = proxy_role(url, self.token) or "not answering"
        if self.proxy_roles.get(job.id) != now:
            self.proxy_roles[job.id] = now
            log(f"{role(job)}: job {job.id} at {url}: {now}")
        if now in ("leader", "alone") and (read_proxy_endpoint(self.bucket) or {}).get("url") != url:
            rec = record_proxy(self.bucket, url, job.id, self.token, written_by=f"supervisor {self.me}")
            log(f"recorded the leader {url} (job {job.id}, incarnation {rec['incarnation']}) in proxy/endpoint.json")
        deaf = time.time() - self.deaf_since.setdefault(job.id, time.time()) if now == "not answering" else 0.0
        if now != "not answering":
            self.deaf_since.pop(job.id, None)
        elif deaf > self.p.proxy_wait_s:   # hung (the other proxy leads by now), or never started: replace it
            log(f"{role(job)}: job {job.id} has not answered /health for {deaf:.0f} s: cancelling it (the next look "
                f"relaunches it as a standby)")
            with hub_errors(f"cancelling the proxy job {job.id}"):
                self.api.cancel_job(job_id=job.id, namespace=self.ns)

    # --- the end of the run -----------------------------------------------------------------

    def final_step(self) -> int | None:
        return final_step(self.specs["trainer"]) if "trainer" in self.specs else None

    def done(self) -> bool:
        """The final version is in the bucket, or the proxy's registry says the run is done."""
        latest, final = self.bucket.get_json("adapters/latest.json"), self.final_step()
        if latest and final and latest.get("step", 0) >= final:
            return True
        record = read_proxy_endpoint(self.bucket)
        if record is None:
            return False
        from huggingface_hub.utils import get_session
        try:
            r = get_session().get(f"{record['url']}/v1/adapters/latest", timeout=10, headers={
                "Authorization": f"Bearer {self.token}", "X-Proxy-Token": secret_values(self.token)["PROXY_TOKEN"]})
            return r.status_code == 200 and r.json().get("done") is True
        except Exception:  # the proxy is down: not known to be done
            return False

    def finish(self) -> int:
        latest = self.bucket.get_json("adapters/latest.json") or {}
        log(f"run {self.run} is done (final version {latest.get('version')}, step {latest.get('step')}); "
            f"waiting up to {self.p.drain_s:g} s for workers and trainer to exit")
        t0 = time.time()
        while True:
            with hub_errors("listing the run's jobs"):
                live = [j for j in newest_by_role(run_jobs(self.api, self.run, self.ns)).values()
                        if stage(j) not in TERMINAL and j.id != self.me]
            if not [j for j in live if role(j) not in ("proxy", "supervisor")] or time.time() - t0 > self.p.drain_s:
                break
            time.sleep(min(self.p.poll_s, 5.0))
        for j in live:
            with hub_errors(f"cancelling {role(j)}"):
                self.api.cancel_job(job_id=j.id, namespace=self.ns)
            log(f"cancelled {role(j)} job {j.id} (the run is over)")
        log(f"run {self.run} finished; the bucket keeps adapters, checkpoints and metrics")
        return 0

    # --- one supervisor per run -------------------------------------------------------------

    def lease_body(self, owner: str | None = None, **extra) -> dict:
        return {"owner": owner or self.me, "job_id": os.environ.get("JOB_ID"), "heartbeat_at": time.time(), **extra}

    def owner_gone(self, lease: dict) -> bool:
        """The lease's owner is a job that has ended (cancelled, or killed before it could release)."""
        if not lease.get("job_id"):
            return False
        try:
            with hub_errors("looking at the supervisor job that holds the lease"):
                return stage(self.api.inspect_job(job_id=lease["job_id"], namespace=self.ns)) in TERMINAL
        except SystemExit:
            return False

    def take_lease(self) -> None:
        got = self.bucket.get(LEASE)
        try:
            if got is None:
                self.etag = self.bucket.put_json(LEASE, self.lease_body(), if_none_match=True)
                return
            lease = json.loads(got[0])
            age = time.time() - lease.get("heartbeat_at", 0)
            if lease.get("owner") != self.me and not lease.get("released") and age < self.ttl \
                    and not self.owner_gone(lease):
                raise SystemExit(f"run {self.run} is already supervised by {lease.get('owner')} (heartbeat {age:.0f} s "
                                 f"ago): stop that one first, or start this one {self.ttl:.0f} s after it died")
            self.etag = self.bucket.put_json(LEASE, self.lease_body(), if_match=got[1])
        except ConflictError:
            raise SystemExit(f"another supervisor took run {self.run} at the same moment") from None

    def heartbeat(self) -> bool:
        try:
            self.etag = self.bucket.put_json(LEASE, self.lease_body(), if_match=self.etag)
            return True
        except BucketError as e:   # the bucket is down: try at the next look (the lease outlives a few misses)
            log(f"heartbeat failed: {e}")
            return True
        except ConflictError:
            log(f"another supervisor took run {self.run} over: exiting")
            self.etag = None
            return False

    def release(self) -> None:
        if self.etag is not None:
            try:
                self.bucket.put_json(LEASE, self.lease_body(released=True), if_match=self.etag)
            except Exception as e:  # it expires by itself after ttl
                print(f"supervisor: releasing the lease failed ({e})", file=sys.stderr)

    def handover_due(self) -> bool:
        """Running as a job, close to its own timeout: time to start a successor."""
        spec = self.specs.get("supervisor")
        if not os.environ.get("JOB_ID") or spec is None:
            return False
        return time.time() > self.t_start + timeout_seconds(spec.timeout) - self.p.handover_s

    def hand_over(self) -> bool:
        try:
            with hub_errors("starting the next supervisor job"):
                job = submit(self.api, self.specs["supervisor"], self.run, self.ns, secret_values(self.token),
                             self.workdir)
            self.etag = self.bucket.put_json(LEASE, self.lease_body(owner=job.id, job_id=job.id, handed_over_by=self.me),
                                             if_match=self.etag)
        except (SystemExit, ConflictError) as e:
            log(f"handing over failed ({e}); carrying on")
            return False
        log(f"my job's timeout is near: supervisor job {job.id} takes over")
        return True

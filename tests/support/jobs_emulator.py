"""Hugging Face Jobs on this machine, below huggingface_hub's own code.

The launcher and the supervisor call `HfApi.run_uv_job`, `inspect_job`, `list_jobs`, `cancel_job`,
`create_bucket` and `whoami` unchanged; huggingface_hub's HTTP client is replaced (through
`set_client_factory`) by a transport that answers the Hub's job API from real local processes, and
the upload of the shipped files (`HfApi.batch_bucket_files`, which hf_xet does outside HTTP) is
recorded. Every other request (the exposed URLs) goes out through a real HTTP transport.

What a submitted job gets, as on the platform:
- its own folder (the job's disk): the files run_uv_job uploaded, copied there at submission (a
  later edit of the local file does not reach it); `/data/` in its command is that folder;
- its environment and secrets, `JOB_ID`, a `HOME` inside its folder (so a relaunched job starts with
  an empty disk, spool included), one CPU thread, no network to the Hub (HF_HUB_OFFLINE=1);
- `uv run [--with X] SCRIPT ARGS` replaced by this venv's python (offline: the venv already has every
  dependency of the scripts' headers);
- each exposed port a new local port at every launch, so a relaunched proxy has a new URL. The job
  is told that port through its own `--port P` argument, which the emulator rewrites, as the
  platform's port mapping takes the public URL to the container's port P; `--host 0.0.0.0` becomes
  127.0.0.1 (the "gateway" here is loopback). A network namespace per job would leave the argv alone
  but needs root; an in-process NAT would need every job to bind the same port P on one machine.
  A job that exposes a port without a `--port P` argument is refused (the emulator could not map it);
- its timeout enforced: at the deadline the process group gets SIGTERM, then SIGKILL after
  `grace_s`; the job reports stage ERROR with message "Job timeout exceeded" (the platform's stage
  for a timeout is not documented; every terminal stage is treated alike by the supervisor);
- stages from the processes' real state: SCHEDULING until started, RUNNING while alive, COMPLETED on
  exit 0, ERROR on another exit status or a signal (an OOM kill is a SIGKILL), CANCELED after
  cancel_job (SIGTERM to the group, SIGKILL after `grace_s`).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx2
from huggingface_hub import HfApi, constants, set_client_factory
from huggingface_hub.utils._http import default_client_factory

HUB_HOST = httpx2.URL(constants.ENDPOINT).host   # huggingface.co unless HF_ENDPOINT said otherwise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class Job:
    def __init__(self, jid: str, spec: dict, folder: Path):
        self.id, self.spec, self.folder = jid, spec, folder
        self.proc: subprocess.Popen | None = None
        self.created, self.started, self.finished = time.time(), None, None
        self.deadline: float | None = None
        self.ports: dict[int, int] = {}        # exposed container port -> local port
        self.ended_by: str | None = None       # "cancel" | "timeout": the platform stopped it
        self.log = folder / "job.log"

    def stage(self) -> tuple[str, str | None]:
        if self.proc is None:
            return "SCHEDULING", None
        rc = self.proc.poll()
        if rc is None:
            return "RUNNING", None
        if self.ended_by == "cancel":
            return "CANCELED", None
        if self.ended_by == "timeout":
            return "ERROR", "Job timeout exceeded"
        if rc == 0:
            return "COMPLETED", None
        return "ERROR", f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"


class JobsEmulator:
    def __init__(self, root: Path, namespace: str = "alice", grace_s: float = 5.0):
        self.root, self.ns, self.grace_s = Path(root), namespace, grace_s
        self.jobs: dict[str, Job] = {}
        self.uploads: dict[str, dict[str, bytes]] = {}   # jobs-artifacts folder -> {name: bytes}
        self.lock = threading.RLock()
        self.real = httpx2.HTTPTransport()
        self.closed = threading.Event()
        self.watchdog = threading.Thread(target=self._enforce_timeouts, daemon=True)
        self.watchdog.start()

    # --- wiring -------------------------------------------------------------------------------

    def install(self, monkeypatch) -> "JobsEmulator":
        emu = self

        class Transport(httpx2.BaseTransport):
            def handle_request(self, request: httpx2.Request) -> httpx2.Response:
                if request.url.host == HUB_HOST:
                    request.read()
                    return emu.handle(request)
                return emu.real.handle_request(request)

        set_client_factory(lambda: httpx2.Client(transport=Transport(), follow_redirects=True))

        def record_upload(api, bucket_id, *, add=None, copy=None, delete=None, token=None):
            for src, dst in add or []:
                folder, name = dst.split("/", 1)
                data = src if isinstance(src, bytes) else Path(src).read_bytes()
                emu.uploads.setdefault(folder, {})[name] = data
        monkeypatch.setattr(HfApi, "batch_bucket_files", record_upload)
        return self

    def close(self) -> None:
        self.closed.set()
        for job in list(self.jobs.values()):
            self._stop(job, "cancel")
        set_client_factory(default_client_factory)

    # --- the Hub's job API --------------------------------------------------------------------

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        path, method = request.url.path, request.method
        if path == "/api/whoami-v2":
            return httpx2.Response(200, json={"name": self.ns, "type": "user", "orgs": []})
        if m := re.fullmatch(r"/api/buckets/([\w-]+)/([\w.-]+)", path):
            return httpx2.Response(200, json={"url": f"https://{HUB_HOST}/buckets/{m[1]}/{m[2]}"})
        if path == f"/api/jobs/{self.ns}" and method == "POST":
            try:
                job = self.start(json.loads(request.content))
            except ValueError as e:
                return httpx2.Response(400, json={"error": str(e)})
            return httpx2.Response(200, json=self.info(job))
        if path == f"/api/jobs/{self.ns}" and method == "GET":
            labels = [tuple(x.split("=", 1)) for x in request.url.params.get_list("label")]
            stages = request.url.params.get_list("stage")
            with self.lock:
                out = [self.info(j) for j in self.jobs.values()
                       if all(j.spec.get("labels", {}).get(k) == v for k, v in labels)]
            return httpx2.Response(200, json=[o for o in out if not stages or o["status"]["stage"] in stages])
        if (m := re.fullmatch(rf"/api/jobs/{self.ns}/(\w+)/cancel", path)) and method == "POST":
            job = self.jobs.get(m[1])
            if job is None:
                return httpx2.Response(404, json={"error": "no such job"})
            self._stop(job, "cancel")
            return httpx2.Response(200, json={})
        if m := re.fullmatch(rf"/api/jobs/{self.ns}/(\w+)", path):
            job = self.jobs.get(m[1])
            if job is None:
                return httpx2.Response(404, json={"error": "no such job"})
            return httpx2.Response(200, json=self.info(job))
        if path.startswith("/api/jobs/"):
            return httpx2.Response(401, json={"error": f"not allowed in namespace {path.split('/')[3]}"})
        return httpx2.Response(404, json={"error": f"jobs emulator: no route for {method} {path}"})

    def info(self, job: Job) -> dict:
        st, msg = job.stage()
        if st not in ("SCHEDULING", "RUNNING") and job.finished is None:
            job.finished = time.time()
        status = {"stage": st, "message": msg}
        if job.ports and st == "RUNNING":
            status["exposeUrls"] = [f"http://127.0.0.1:{p}" for p in job.ports.values()]
        spec = job.spec
        return {"id": job.id, "createdAt": iso(job.created), "startedAt": iso(job.started),
                "finishedAt": iso(job.finished),
                "dockerImage": spec.get("dockerImage"), "command": spec["command"], "arguments": [],
                "environment": spec.get("environment", {}), "secrets": sorted(spec.get("secrets", {})),
                "flavor": spec.get("flavor"), "labels": spec.get("labels", {}), "status": status,
                "expose": spec.get("expose"), "owner": {"id": "u1", "name": self.ns, "type": "user"}}

    # --- running a job ------------------------------------------------------------------------

    def command(self, spec: dict, folder: Path, ports: dict[int, int]) -> list[str]:
        """`uv run [--with X] [--python V] SCRIPT ARGS` -> this venv's python with the job's paths."""
        cmd = list(spec["command"])
        if cmd[:2] != ["uv", "run"]:
            raise ValueError(f"jobs emulator runs `uv run` commands only, not {cmd[:2]}")
        rest, i = cmd[2:], 0
        while i < len(rest) and rest[i] in ("--with", "--python"):
            i += 2
        argv = [str(folder / a[len("/data/"):]) if a.startswith("/data/") else a for a in rest[i:]]
        argv = [a.replace("jsonl:/data/", f"jsonl:{folder}/") for a in argv]
        for inner, outer in ports.items():
            hits = [k for k in range(len(argv) - 1) if argv[k] == "--port" and argv[k + 1] == str(inner)]
            if not hits:
                raise ValueError(f"jobs emulator: exposed port {inner} must be the job's `--port {inner}` argument")
            argv[hits[0] + 1] = str(outer)
        argv = ["127.0.0.1" if a == "0.0.0.0" and k and argv[k - 1] == "--host" else a for k, a in enumerate(argv)]
        return [sys.executable, *argv]

    def start(self, spec: dict) -> Job:
        with self.lock:
            jid = f"{len(self.jobs) + 1:024x}"
            folder = self.root / jid
            folder.mkdir(parents=True)
            job = Job(jid, spec, folder)
            for vol in spec.get("volumes", []):
                if vol.get("mountPath") == "/data":
                    for name, data in self.uploads[vol["path"]].items():
                        (folder / name).write_bytes(data)
            job.ports = {p: free_port() for p in (spec.get("expose") or {}).get("ports", [])}
            cmd = self.command(spec, folder, job.ports)
            home = folder / "home"
            home.mkdir()
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
                   "JOB_ID": jid, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                   "HF_HOME": str(home / "hf"), **spec.get("environment", {}), **spec.get("secrets", {})}
            job.proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=open(job.log, "w"), stderr=subprocess.STDOUT,
                                        start_new_session=True)
            job.started = time.time()
            if spec.get("timeoutSeconds"):
                job.deadline = job.started + spec["timeoutSeconds"]
            self.jobs[jid] = job
            return job

    def _stop(self, job: Job, why: str) -> None:
        """What the platform does to end a job: SIGTERM to everything in it, SIGKILL after grace_s."""
        with self.lock:
            if job.proc is None or job.proc.poll() is not None:
                return
            job.ended_by = why
            _signal(job.proc, signal.SIGTERM)
        try:
            job.proc.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            _signal(job.proc, signal.SIGKILL)
            job.proc.wait()
        job.finished = time.time()

    def _enforce_timeouts(self) -> None:
        while not self.closed.wait(0.2):
            for job in list(self.jobs.values()):
                if job.proc is not None and job.proc.poll() is None and job.deadline and time.time() >= job.deadline:
                    threading.Thread(target=self._stop, args=(job, "timeout"), daemon=True).start()
                    job.deadline = None

    # --- what a test does to jobs -------------------------------------------------------------

    def crash(self, job_id: str, sig: int = signal.SIGKILL) -> None:
        """The job's processes die (a crash, an OOM kill): the platform reports ERROR."""
        job = self.jobs[job_id]
        _signal(job.proc, sig)
        job.proc.wait()

    def pause(self, job_id: str) -> None:
        """The job's processes stop being scheduled (a frozen host, a long GC pause): SIGSTOP; still RUNNING."""
        _signal(self.jobs[job_id].proc, signal.SIGSTOP)

    def resume(self, job_id: str) -> None:
        _signal(self.jobs[job_id].proc, signal.SIGCONT)

    def expire(self, job_id: str) -> None:
        """The job's timeout is reached now."""
        self.jobs[job_id].deadline = time.time()

    def by_role(self, role: str) -> list[Job]:
        return [j for j in self.jobs.values() if j.spec.get("labels", {}).get("role") == role]

    def text(self, job: Job) -> str:
        return job.log.read_text(errors="replace")


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass

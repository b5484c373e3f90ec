"""The `spawn` fixture: proxy.py as a real process, with the flags, environment, soft file limit or
wall-clock offset a test needs (conftest's start_proxy covers the common case). Import it into a test
module (`from proxyproc import spawn`) to use it there. Also the helpers the proxy tests wait with:
wait_for (poll a condition, bounded), wait_port, Worker (a thread whose failure fails the test) and
metric (one sample of /metrics)."""
import os
import resource
import secrets
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, ProxyProc, free_port, stop, wait_http

# runs proxy.py with time.time() shifted: a host whose clock is off, emulated below the proxy's own code
SKEWED = ("import runpy, sys, time; _t, _d = time.time, float(sys.argv[1]); time.time = lambda: _t() + _d; "
          "sys.argv = sys.argv[2:]; sys.path.insert(0, __import__('os').path.dirname(sys.argv[0])); "
          "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.fixture
def spawn(s3_env, run_name, tmp_path):
    """start(*flags, env=, nofile=, port=, clock_skew_s=) -> ProxyProc (with .log, .port); all stopped at the end."""
    procs = []

    def start(*flags, env=None, nofile=None, port=None, clock_skew_s=None, token=None) -> ProxyProc:
        port, token = port or free_port(), token or secrets.token_urlsafe(16)
        full_env = {**os.environ, "RUN_NAME": run_name, "PROXY_TOKEN": token, **(env or {})}
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))) if nofile else None
        cmd = [str(ROOT / "proxy.py"), "--port", str(port), "--group-size", "4", *flags]
        cmd = [sys.executable, *(["-c", SKEWED, str(clock_skew_s)] if clock_skew_s else []), *cmd]
        log = open(tmp_path / f"proxy-{port}-{len(procs)}.log", "w")
        proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=log, preexec_fn=limit)
        procs.append(proc)
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=60)
        p = ProxyProc(f"http://127.0.0.1:{port}", token, proc)
        p.log, p.port = log.name, port
        return p

    yield start
    for p in procs:
        stop(p)


def rss_hwm_mb(pid: int) -> float:
    """The kernel's high-water mark of the process's resident memory."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


# ---- waiting for a condition, not sleeping and hoping: each wait is bounded and says what it waited for ----
def wait_for(what, timeout: float = 60.0, every: float = 0.05, msg: str = ""):
    """what() polled until it is truthy (returned); an AssertionError naming `msg` after `timeout` seconds.
    The timeouts are generous on purpose: a loaded 2-core machine is slow, not broken."""
    t0 = time.monotonic()
    while not (got := what()):
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout:g} s waiting for {msg or what}"
        time.sleep(every)
    return got


def wait_port(port: int, proc: subprocess.Popen | None = None, timeout: float = 30.0) -> None:
    """Something (a forwarder process) accepts connections on 127.0.0.1:port."""
    def up() -> bool:
        assert proc is None or proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False
    wait_for(up, timeout, every=0.05, msg=f"127.0.0.1:{port} to accept connections")


class Worker(threading.Thread):
    """A thread whose failure fails the test: join() re-raises what it raised, and a thread still running
    after the join's timeout is an error too (an assertion inside a plain thread fails nothing)."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.error, self.value = fn, args, None, None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - handed to join()
            self.error = e

    def join(self, timeout: float | None = 60.0):
        super().join(timeout)
        assert not self.is_alive(), f"{self.fn.__name__} still running after {timeout} s"
        if self.error is not None:
            raise self.error
        return self.value


def metric(p, name: str, **labels) -> float:
    """One sample of the proxy's /metrics (Prometheus text), 0 if absent: e.g. metric(p,
    "proxy_request_seconds_count", method="POST", route="/v1/batches/lease") counts lease requests that ended."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in p.http.get("/metrics").text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == want:
            return float(value)
    return 0.0

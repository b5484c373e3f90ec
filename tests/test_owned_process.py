"""A server a role starts (lib/shared/owned_process.py: an OpenEnv environment's, vLLM's or SGLang's) does not
outlive the role, even one killed with SIGKILL, which runs no cleanup of its own."""
import os
import signal
import subprocess
import sys
import time

from conftest import ROOT

STARTS_A_SERVER = """
import sys, time
from owned_process import popen_owned
server = popen_owned([sys.executable, "-c", "import time; print('serving', flush=True); time.sleep(600)"])
print(server.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running, not a zombie left for whoever reaps orphans here."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_server_dies_with_the_role_that_started_it_even_killed_9():
    role = subprocess.Popen([sys.executable, "-c", STARTS_A_SERVER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "lib" / "shared")})
    try:
        server = int(role.stdout.readline())
        assert role.stdout.readline() == "serving\n"  # the server itself runs (it shares the role's stdout)
        assert alive(server) and os.getpgid(server) == server  # its own process group: signals to it reach its children
        role.send_signal(signal.SIGKILL)
        role.wait(10)
        deadline = time.monotonic() + 10
        while alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(server), "the server outlived the role that started it"
    finally:
        role.kill()
        role.wait()

"""A server a role starts and owns (an inference server, an OpenEnv environment's server): in a process group of
its own, so that stopping it (a signal to the group) stops what it started in turn, and killed by the kernel the
moment the thread that started it ends, even when the role itself is killed with SIGKILL (PR_SET_PDEATHSIG, Linux):
no server outlives the worker that started it, to hold its port and memory. Start it from the role's main thread
(a thread that ends would take the server with it).

The tie is made by a few lines of Python that the server's command is started under and that then become the
server (exec), not by subprocess's preexec_fn, which runs Python between fork and exec and can deadlock when the
role has other threads (the worker has)."""
from __future__ import annotations

import os
import subprocess
import sys

# argv: the owner's pid, then the command. Checking the parent after the tie closes the race of an owner that died
# before it was made (the orphan then has another parent already, and must not start)
TIE = ("import ctypes, os, signal, sys\n"
       "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
       "sys.exit(1) if os.getppid() != int(sys.argv[1]) else os.execvp(sys.argv[2], sys.argv[2:])\n")


def owned_command(cmd: list[str]) -> list[str]:
    """`cmd`, started under the tie to this process's life (Linux; elsewhere as it is)."""
    return [sys.executable, "-c", TIE, str(os.getpid()), *cmd] if sys.platform.startswith("linux") else list(cmd)


def popen_owned(cmd: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen of `cmd` in a session of its own, killed when this process dies."""
    return subprocess.Popen(owned_command(cmd), start_new_session=True, **kwargs)

"""A server a role starts and owns (an inference server, an OpenEnv environment's server): in a process group of
its own, so that stopping it (a signal to the group) stops what it started in turn, and killed by the kernel the
moment the thread that started it ends, even when the role itself is killed with SIGKILL (PR_SET_PDEATHSIG, Linux):
no server outlives the worker that started it, to hold its port and memory. Start it from the role's main thread
(a thread that ends would take the server with it)."""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def _die_with_parent() -> None:  # runs in the child, between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def popen_owned(cmd: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(cmd, **kwargs) in its own session, tied to this process's life (Linux; elsewhere it only
    gets its own session)."""
    return subprocess.Popen(cmd, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None, **kwargs)

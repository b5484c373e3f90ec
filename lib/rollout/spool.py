"""What a rollout worker keeps on its own disk: the spool of finished groups (each fsynced to a file before
it is sent, and removed only once the proxy has answered for it, so a proxy outage, the worker's own
restart or a power cut loses nothing), and, for a worker without bucket keys, its metrics beside it.
rollout.py uses it."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from common import WAIT_LOG_S, log
from metrics import Metrics
from proxy_client import ProxyClient, ProxyError, TokenRefused




class Spool:
    """One file per group in `{root}/{run}/{worker_id}/`; `refused/` keeps what the proxy refused
    (4xx), `unreadable/` what could not be read back (a file cut short by a power cut, say)."""

    def __init__(self, root: str, run: str, worker_id: str, log=log):
        self.dir = os.path.join(root, run, worker_id)  # per run: never resubmit into another run
        self.log = log
        for sub in ("refused", "unreadable"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        self.held: list[dict] = []  # groups the disk would not take: sent from memory, never dropped
        self._said_full = -WAIT_LOG_S
        self._sweep_tmp()

    def _sweep_tmp(self, older_s: float = 60.0) -> None:
        """Temp files older than a minute are writes a crash cut short: their group was never
        acknowledged to anyone (add() had not returned), so they go."""
        stale = [p for p in glob.glob(os.path.join(glob.escape(self.dir), ".*.tmp"))
                 if time.time() - _mtime(p, time.time()) > older_s]
        for p in stale:
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
        if stale:
            self.log(f"spool {self.dir}: removed {len(stale)} stale temp file(s) left by a write cut short")

    def add(self, group: dict) -> None:
        """Write the group (file, then directory, fsynced) before anyone hears of it. If the disk
        will not take it (full, quota, I/O error) it stays in memory and goes to the proxy from
        there at the next flush; we say so (every 30 s at most) and carry on."""
        gid = group["group_id"]
        tmp = os.path.join(self.dir, f".{gid}.tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(group, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.dir, f"{gid}.json"))  # atomic: never half a file
            _fsync_dir(self.dir)  # the rename itself is durable
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            self.held.append(group)
            if time.monotonic() - self._said_full >= WAIT_LOG_S:
                self._said_full = time.monotonic()
                self.log(f"spool {self.dir}: cannot write group {gid} ({e.strerror or e}); {len(self.held)} "
                         f"group(s) held in memory until the proxy takes them: free space on that disk")

    def pending(self) -> list[str]:
        names = [n for n in os.listdir(self.dir) if n.endswith(".json")]
        return sorted(names, key=lambda n: _mtime(os.path.join(self.dir, n), 0.0))

    def _read(self, name: str) -> dict | None:
        """The spooled group, or None: gone, or unreadable (then moved to unreadable/ and named)."""
        path = os.path.join(self.dir, name)
        try:
            with open(path) as f:
                group = json.load(f)
            if not isinstance(group, dict) or not isinstance(group.get("group_id"), str):
                raise ValueError("not a trajectory group")
            return group
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            dest = os.path.join(self.dir, "unreadable", name)
            with contextlib.suppress(OSError):
                os.replace(path, dest)
            self.log(f"spool file {path} is unreadable ({type(e).__name__}: {str(e)[:200]}): set aside as {dest}")
            return None

    def _send(self, client: ProxyClient, group: dict, name: str | None) -> str | None:
        """Post one group; its status, "refused" (4xx: kept in refused/), or None (proxy unreachable
        and we are stopping). TokenRefused (this token is refused on every route) is raised, the group kept where
        it is: it was not judged, and the run's owner may yet let the token back in."""
        try:
            status = client.post("/v1/groups", group)["status"]
        except TokenRefused:
            raise
        except ProxyError as e:  # 4xx: resending cannot help; keep it aside for inspection
            dest = os.path.join(self.dir, "refused", f"{group['group_id']}.json")
            try:
                if name:
                    os.replace(os.path.join(self.dir, name), dest)
                else:
                    with open(dest, "w") as f:
                        json.dump(group, f)
            except OSError as err:
                self.log(f"could not keep refused group {group['group_id']} in {dest}: {err}")
            self.log(f"group {group['group_id']} refused, kept in {self.dir}/refused: {e}")
            return "refused"
        except httpx.HTTPError as e:
            self.log(f"proxy unreachable ({type(e).__name__}); {len(self.pending())} group(s) stay spooled in "
                     f"{self.dir}" + (f", {len(self.held)} held in memory are lost" if self.held else ""))
            return None
        if name:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.dir, name))
        return status

    def flush(self, client: ProxyClient, at_once: int = 8) -> list[tuple[str, str]]:
        """Send what memory holds, then every spooled group, oldest first, `at_once` at a time. The proxy
        answers a group once its journal line is in the bucket, and the groups that arrive together share
        one journal write: a round's groups sent one by one would each wait for a write of their own (at
        1,000 simulated workers a round's posts took a median 0.42-0.46 s one by one, 0.05-0.21 s together;
        docs/results/fleet.md). The first goes alone, so that an outage is waited out, and said, by one call. The
        client waits out a proxy outage; it gives up only when we are stopping, and then the rest stays on
        disk (or in memory). Returns (group_id, the proxy's status) per group sent."""
        items = [(g, None) for g in self.held] + [(None, name) for name in self.pending()]
        if not items:
            return []

        stopped = threading.Event()  # the proxy unreachable and we are stopping: the rest stays

        def send(item: tuple[dict | None, str | None]) -> tuple[str, str] | None:
            group, name = item
            if stopped.is_set() or (group is None and (group := self._read(name)) is None):
                return None
            if (status := self._send(client, group, name)) is None:
                stopped.set()
                return None
            return group["group_id"], status
        first, rest = send(items[0]), []
        if len(items) > 1 and not stopped.is_set():
            with ThreadPoolExecutor(min(at_once, len(items) - 1)) as pool:
                rest = list(pool.map(send, items[1:]))
        outs = [first, *rest]  # one per item tried (zip stops where a stop left the rest untried)
        sent = {id(group) for (group, _), out in zip(items, outs) if group is not None and out is not None}
        self.held = [g for g in self.held if id(g) not in sent]
        return [out for out in outs if out is not None]

    def drop_all(self, why: str) -> None:
        """Forget what is left (the run is over: it would never be trained), saying how much."""
        n = len(self.held) + len(names := self.pending())
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.dir, name))
        self.held.clear()
        if n:
            self.log(f"{why}: {n} group(s) left in the spool will never be trained; dropped")


def _mtime(path: str, default: float) -> float:
    try:
        return os.path.getmtime(path)
    except FileNotFoundError:
        return default


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalMetrics(Metrics):
    """A worker without bucket keys keeps its rows on its own disk, in metrics.jsonl beside its spool (the
    run still sees its groups' timings in the trainer's rows, and its groups per second in the proxy's
    /v1/stats and /metrics)."""

    def __init__(self, path: str):
        super().__init__(None, "local")
        self.path = path
        if os.path.exists(path):  # a restarted worker continues its file
            with open(path) as f:
                self.lines = f.read().splitlines()

    def flush(self) -> None:
        self._last = time.time()
        with open(self.path + ".tmp", "w") as f:
            f.write("".join(line + "\n" for line in self.lines))
        os.replace(self.path + ".tmp", self.path)

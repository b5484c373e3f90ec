"""How a rollout worker gets each new adapter version. One thread long-polls the proxy for versions and opens
its next poll as soon as one is answered; another downloads and verifies each new version (from the bucket,
or without bucket keys through the URLs the proxy hands out) and reads its tensors; rollout.py's main loop
swaps them in (between rounds, or mid-round). The open poll is the worker's sign of life for pacing: with no
poll open for --poll-grace-s (a dead process's connection closes; a dead process opens no next one), the proxy
grants the worker's share of the trainer's demand to others, not after --grant-s. Downloading in a thread of
its own keeps the poll open through a long download, and a version announced meanwhile is seen at once.
rollout.py uses it."""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time

import httpx

from common import MAX_STALENESS, AdapterError, Bucket, BucketError, KnownFiles, fetch_adapter
from proxy_client import ProxyClient, ProxyError, TokenRefused, fetch_adapter_via_proxy

log = logging.getLogger("rollout")  # rollout.py's: its lines are the worker's


class AdapterSync(threading.Thread):
    def __init__(self, client: ProxyClient, bucket: Bucket | None, *, model: str, worker_id: str,
                 max_lora_rank: int = 256, poll_s: float = 30.0, module_names: set[str] | None = None):
        """model: the base model the worker serves; max_lora_rank: the largest rank it loads; poll_s: how long a
        poll waits for a new version; module_names: the base model's module names (hf backend), else None."""
        super().__init__(daemon=True)
        self.client, self.bucket, self.model, self.worker_id = client, bucket, model, worker_id
        self.max_lora_rank, self.poll_s, self.module_names = max_lora_rank, poll_s, module_names
        self.seen = 0      # newest version downloaded and verified
        self.failed = 0    # newest version that failed to download or verify (retried until a newer one is seen)
        self.why_failed = ""  # and why
        self.latest = 0    # newest version the proxy announced
        self.published: float | None = None  # when the proxy registered `latest` (this process's clock)
        self.final = False  # the proxy said the run is over (its final version is `latest`)
        self.ready: dict | None = None  # the newest verified version, waiting to be swapped in
        self.done = False  # the final version is handled (or the main loop says the run is over)
        self.token_refused: TokenRefused | None = None  # the proxy refuses our token on every route: polls stopped
        self.max_staleness = MAX_STALENESS  # the proxy's, from its first answer on
        self.lock = threading.Condition()
        self.workdir = tempfile.mkdtemp(prefix="adapters-")
        self.known = KnownFiles()  # adapter_config.json: the same in every version, fetched once
        self.fetcher = threading.Thread(target=self.fetch_newest, daemon=True)

    def run(self) -> None:
        self.fetcher.start()
        while not (self.done or self.final):
            try:
                r = self.client.get("/v1/adapters/latest", after=self.latest, wait_s=self.poll_s,
                                    worker_id=self.worker_id)
            except TokenRefused as e:  # every later poll would be refused too: the main loop stops (rollout.py)
                self.token_refused = e
                return
            except Exception as e:  # proxy down: keep serving what we have, try again
                log.info(f"adapter poll failed: {e}")
                time.sleep(2.0)
                continue
            with self.lock:
                self.max_staleness = r["max_staleness"]
                if r["version"] > self.latest:
                    self.latest, self.published = r["version"], registered_at(r)
                self.final = self.final or r["done"]
                self.lock.notify_all()

    def fetch_newest(self) -> None:
        """Downloads the newest version announced, each time there is a newer one than we hold; a version that
        fails to download or verify is tried again every 2 s until a newer one comes. Done once the final
        version is handled."""
        from safetensors.torch import load_file
        while not self.done:
            with self.lock:  # (the main loop may set done without a word: look again every second)
                if not self.lock.wait_for(lambda: self.latest > self.seen or self.final or self.done, timeout=1.0):
                    continue
                v, published = self.latest, self.published
            if self.done:
                return
            if v <= self.seen:  # the run is over and its last version is here already
                self.done = True
                return
            try:
                d = os.path.join(self.workdir, f"v{v:06d}")
                meta = (fetch_adapter(self.bucket, v, d, self.known) if self.bucket is not None
                        else fetch_adapter_via_proxy(self.client, v, d, self.known))
                check_fits(meta, self.model, self.max_lora_rank, self.module_names)
                tensors = load_file(os.path.join(d, "adapter_model.safetensors"))
                with self.lock:
                    self.ready = {"version": v, "dir": d, "meta": meta, "tensors": tensors,
                                  "published": published, "ready": time.monotonic()}
                self.seen = v
            except TokenRefused as e:
                self.token_refused = e
                return
            except (AdapterError, BucketError, ProxyError, httpx.HTTPError, OSError) as e:
                if self.done:  # the worker is stopping and has removed the folder this download was writing to
                    return
                # never load what does not verify: keep the previous version, retry shortly
                log.info(f"not loading version {v}: {e}")
                self.failed, self.why_failed = max(self.failed, v), f"version {v} not loaded: {e}"
                if self.final and v == self.latest:
                    self.done = True  # the final version does not verify: nothing more will come
                    return
                time.sleep(2.0)

    def close(self, wait_s: float = 10.0) -> None:
        """Stops downloading (a download under way gets up to wait_s to end), then deletes every downloaded
        version: the bucket keeps them all."""
        self.done = True
        if self.fetcher.is_alive():
            self.fetcher.join(timeout=wait_s)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def take(self) -> dict | None:
        with self.lock:
            got, self.ready = self.ready, None
            return got

    def prune(self, in_use: int) -> None:
        """Deletes the files of every version older than the one in use. A days-long run publishes thousands
        of versions and each is a full adapter on disk; once a newer one is swapped in, no engine reads an
        older one again (vLLM and the servers load a version when it is swapped in, the hf backend holds
        its tensors in memory). Newer ones, being downloaded or waiting, are left alone."""
        for name in os.listdir(self.workdir):
            if re.fullmatch(r"v\d{6}", name) and int(name[1:]) < in_use:
                shutil.rmtree(os.path.join(self.workdir, name), ignore_errors=True)


def registered_at(answer: dict) -> float | None:
    """When the proxy registered the version it announces, on this process's monotonic clock: its
    `age_s` says how long ago on the proxy's own monotonic clock, so timings never compare two
    hosts' wall clocks (None: the proxy does not know, e.g. a version registered before its restart)."""
    return None if answer["age_s"] is None else time.monotonic() - answer["age_s"]


def check_fits(meta: dict, model: str, max_lora_rank: int, module_names: set[str] | None) -> None:
    """Refuse an adapter that does not fit the model we serve (rank, base model, target modules)."""
    if meta["lora"]["r"] > max_lora_rank:
        raise AdapterError(f"rank {meta['lora']['r']} above the limit {max_lora_rank}")
    targets = meta["lora"]["target_modules"]
    # peft stores either short names ("q_proj") or, for "all-linear", full paths of the modules
    unknown = {t for t in ([targets] if isinstance(targets, str) else targets) if t != "all-linear"
               and t not in (module_names or ()) and not any(n.endswith("." + t) for n in module_names or ())}
    if module_names is not None and unknown:
        raise AdapterError(f"target modules {sorted(unknown)} do not exist in {model!r}")
    if meta.get("base_model") not in (None, model):
        raise AdapterError(f"adapter trained on {meta['base_model']!r}, this worker serves {model!r}")

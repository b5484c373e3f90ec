"""OpenEnv environments (Hugging Face and Meta's environment servers, PyPI `openenv-core`) as environments of
several turns (environments.py): `--task openenv:URL` drives a server someone runs (a Space, a container, a
process), `--task openenv:PATH.py:APP` starts the server in PATH.py (an app made with openenv's own
`create_app`) on loopback here and stops it at the end.

An OpenEnv server speaks typed actions and observations (GET /schema) over a WebSocket session per
episode (openenv's own client, `GenericEnvClient(...).sync()`): reset(seed) gives the first observation,
step(action) the next one with a reward and `done`. The model's turn becomes the action's one text field
(the schema's only string property, Optional[str] included, or `?action_field=NAME`); an observation becomes a
user message (its one text field, or `?observation_field=NAME`, else its fields as JSON). An MCP environment
(CallToolAction: a tool's name and arguments) is refused: no model turn can drive it. Prompt index i resets
with seed i (eval: seeds from 1,000,003 on), so the G episodes of a group start from the same observation,
which is the group's shared prompt; a server that answers another first observation to the same seed breaks
that, and its episodes are counted as drift and not trained; one whose first observations for seeds 0 and 1
are the same is warned about (it may ignore the seed). The episode's reward is the sum of its steps' rewards;
an episode with none (openenv sends a NaN reward as null) drops its group, saying so.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import parse_qs, urlsplit

import httpx

from env_types import Environment, Session, Step, require
from owned_process import popen_owned

SKIP = {"done", "reward", "metadata"}  # fields every OpenEnv observation has besides its own
EVAL_SEED = 1_000_003
log = logging.getLogger(__name__)
CAPACITY_WAIT_S = 120.0  # a session refused because the server is full is asked for again this long


def start_server(path_app: str) -> tuple[str, subprocess.Popen]:
    """Start `uvicorn MODULE:APP` for PATH.py:APP on a free loopback port; (its URL, the process)."""
    path, _, app = path_app.rpartition(":")
    if not path.endswith(".py") or not os.path.isfile(path) or not app:
        raise SystemExit(f"openenv:{path_app}: expected an http(s) URL or PATH.py:APP (a file that exists)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(tempfile.gettempdir(), f"openenv-{port}.log"), "w")
    proc = popen_owned([sys.executable, "-m", "uvicorn", f"{os.path.basename(path)[:-3]}:{app}", "--app-dir",
                        os.path.dirname(os.path.abspath(path)), "--host", "127.0.0.1", "--port", str(port)],
                       stdout=log, stderr=subprocess.STDOUT)  # gone with the worker, even one killed -9
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the OpenEnv server {path_app} exited ({proc.returncode}) while starting: see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the OpenEnv server {path_app} did not answer {url}/health within 60 s (log: {log.name})")


def is_text(prop: dict) -> bool:
    """A property the model's text can fill: a string, or an optional one (pydantic's Optional[str] is anyOf string,
    null), and not a constant (a discriminator such as an action's `type`)."""
    types = {t.get("type") for t in prop["anyOf"]} if "anyOf" in prop else {prop.get("type")}
    return "const" not in prop and "string" in types and types <= {"string", "null"}


def text_field(schema: dict, given: str | None, what: str) -> str | None:
    """The one text property of a JSON schema (or `given`, checked); None when there is not exactly one."""
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k not in SKIP}
    if given:
        if given not in props:
            raise SystemExit(f"the OpenEnv {what} has no field {given!r}; its fields: {sorted(props)}")
        return given
    strings = [k for k, v in props.items() if is_text(v)]
    return strings[0] if len(strings) == 1 else None


def refuse_mcp(action: dict, url: str) -> None:
    """An MCP environment (its action is openenv's CallToolAction: a tool's name and its arguments) cannot take a
    model's text as its action: given ?action_field=tool_name, every step is a call of no tool, answered with an
    error, and the run would train on those. Refused at start, saying so."""
    props = action.get("properties") or {}
    if action.get("title") in ("CallToolAction", "ListToolsAction") or {"tool_name", "arguments"} <= set(props):
        raise SystemExit(f"the OpenEnv environment at {url} is an MCP environment (its action is "
                         f"{action.get('title', 'a tool call')}: a tool's name and its arguments), which a model's "
                         "text turn cannot drive: --task openenv: needs an environment whose action has a text field")


def same_prompts(prompts: "Prompts") -> str | None:
    """A warning when the first two prompt indices start alike (a server that ignores reset's seed gives one prompt
    for every index: the run would train on one question), else None."""
    if len(prompts) < 2 or prompts.text(0) != prompts.text(1):
        return None
    return (f"the OpenEnv server at {prompts.url} gave the same first observation for seeds {prompts.seed0} and "
            f"{prompts.seed0 + 1} ({prompts.text(0)[:80]!r}): if it ignores reset's seed, every prompt index is one "
            "question; if its episodes differ by the seed only after the first observation, this is fine")


def refused(err: Exception) -> bool:
    """Whether a session was refused because the server holds as many as it allows: its CAPACITY_REACHED error,
    or the connection it closes right after sending it (which our first message can meet before the error)."""
    from websockets.exceptions import ConnectionClosed
    return "CAPACITY_REACHED" in str(err) or isinstance(err, ConnectionClosed)


def close_quietly(client) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - a refused or broken connection: nothing left to tell the server
        pass


def open_reset(client_cls, url: str, seed: int, patience_s: float = CAPACITY_WAIT_S):
    """A connected sync client and its reset(seed). A session refused for capacity is asked for again (the slot of
    an episode that just ended is freed a moment after it closes; another worker's may end) for patience_s, then
    the refusal is raised, naming the server's limit."""
    t0 = time.monotonic()
    while True:
        client = client_cls(base_url=url).sync()
        try:
            client.connect()
            return client, client.reset(seed=seed)
        except Exception as e:
            close_quietly(client)
            if not refused(e):
                raise
            if time.monotonic() - t0 > patience_s:
                raise RuntimeError(f"the OpenEnv server at {url} refused a session for {patience_s:.0f} s: it holds "
                                   f"as many as it allows (its create_app(..., max_concurrent_envs=N)): {e}") from e
        time.sleep(0.2)


def session_limit(client_cls, url: str, want: int) -> int | None:
    """How many sessions the server at url allows open at once, if fewer than `want` (None: it took `want`).
    openenv's server says its limit only when it refuses one, so sessions are opened one after another (each
    asked for its state) until one is refused, then all are closed."""
    opened = []
    try:
        for n in range(want):
            opened.append(client := client_cls(base_url=url).sync())
            try:
                client.connect()
                client.state()
            except Exception as e:
                if refused(e):
                    return max(n, 1)  # (none at all: another client holds them; ours wait for one, open_reset)
                raise
        return None
    finally:
        for client in opened:
            close_quietly(client)


class OpenEnvSession(Session):
    def __init__(self, client_cls, url: str, action_field: str, render, first: str, seed: int):
        self.action_field, self.render = action_field, render
        self.client, reset = open_reset(client_cls, url, seed)
        got = render(reset.observation)
        self.mismatch = None if got == first else (
            f"the server's first observation for seed {seed} is not the group's prompt ({got[:80]!r} vs "
            f"{first[:80]!r}): the environment does not reset deterministically from its seed")
        self.rewards: list[float | None] = []

    def step(self, text: str) -> Step:
        if self.mismatch:
            return Step([], done=True, mismatch=self.mismatch)
        r = self.client.step({self.action_field: text})
        if r.reward is not None and not math.isfinite(float(r.reward)):  # a failing step drops its group, saying this
            raise ValueError(f"the environment's reward is {r.reward}, not a number")
        self.rewards.append(r.reward)  # None: a step without a reward (or a NaN: openenv sends one as null)
        return Step([] if r.done else [{"role": "user", "content": self.render(r.observation)}], done=bool(r.done))

    def score(self) -> tuple[float, dict[str, float]]:
        """The sum of the steps' rewards. An episode none of whose steps had a reward is refused (its group dropped,
        saying so): openenv's server sends a NaN reward as null, which would otherwise be trained as 0."""
        if self.rewards and all(r is None for r in self.rewards):
            raise ValueError(f"the environment gave no reward in {len(self.rewards)} step(s) (null every time: "
                             "openenv sends a NaN reward as null)")
        total = float(sum(r for r in self.rewards if r is not None))
        return total, {"correct": total, "diag_env_steps": float(len(self.rewards))}

    def close(self) -> None:
        close_quietly(self.client)  # (a server gone at the end of a run: nothing left to tell it)


class Prompts:
    """The first observation of each prompt index, asked of the server once and kept (index -> messages)."""

    def __init__(self, client_cls, url: str, render, system: str | None, size: int, seed0: int):
        self.client_cls, self.url, self.render, self.system, self.size, self.seed0 = (
            client_cls, url, render, system, size, seed0)
        self.cache: dict[int, str] = {}

    def __len__(self) -> int:
        return self.size

    def text(self, i: int) -> str:
        if i not in self.cache:
            client, reset = open_reset(self.client_cls, self.url, self.seed0 + i)
            close_quietly(client)
            self.cache[i] = self.render(reset.observation)
        return self.cache[i]

    def __getitem__(self, i: int) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": self.text(i)}]


def stop_server(proc: subprocess.Popen | None) -> None:
    """Stops a server start_server started (None: one the user runs, left alone)."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def openenv_environment(spec: str, split: str = "train", seed: int = 0, sessions: int = 0) -> Environment:
    """sessions: how many the caller opens at once at most (rollout: G x prompts per round); the server's own
    limit, if lower, is learnt now (Environment.max_sessions), and the episodes run in waves of it."""
    require("openenv-core", "openenv")
    parts = urlsplit(spec) if spec.startswith(("http://", "https://")) else None
    opts = {k: v[-1] for k, v in parse_qs(parts.query if parts else spec.partition("?")[2]).items()}
    if parts:
        return _connect(spec, spec.split("?", 1)[0].rstrip("/"), None, opts, parts, split, seed, sessions)
    url, proc = start_server(spec.split("?", 1)[0])
    try:
        return _connect(spec, url, proc, opts, parts, split, seed, sessions)
    except BaseException:  # refused at start (an MCP environment, no text field, ...): the server started goes too
        stop_server(proc)
        raise


def _connect(spec: str, url: str, proc: subprocess.Popen | None, opts: dict, parts, split: str, seed: int,
             sessions: int) -> Environment:
    """openenv_environment once its server is known (proc: one it started, stopped by the Environment's close)."""
    from openenv.core.generic_client import GenericEnvClient
    try:
        schema = httpx.get(f"{url}/schema", timeout=30.0).raise_for_status().json()
    except httpx.HTTPError as e:
        raise SystemExit(f"the OpenEnv server at {url} does not answer GET /schema: {e}") from e
    refuse_mcp(schema["action"], url)
    action_field = text_field(schema["action"], opts.get("action_field"), "action")
    if action_field is None:
        raise SystemExit(f"the OpenEnv action at {url} has no single text field: name it with "
                         f"openenv:{spec.split('?')[0]}?action_field=NAME (fields: {sorted(schema['action'].get('properties', {}))})")
    obs_field = text_field(schema["observation"], opts.get("observation_field"), "observation")

    def render(obs: dict) -> str:
        if obs_field:
            return str(obs.get(obs_field, ""))
        return json.dumps({k: v for k, v in obs.items() if k not in SKIP}, sort_keys=True)
    seed0 = (seed if split == "train" else seed + EVAL_SEED)
    prompts = Prompts(GenericEnvClient, url, render, opts.get("system"), int(opts.get("size", 1000)), seed0)
    if warning := same_prompts(prompts):
        log.warning(warning)

    def session(i: int) -> Session:
        return OpenEnvSession(GenericEnvClient, url, action_field, render, prompts.text(i), seed0 + i)

    def close() -> None:
        stop_server(proc)
    name = "openenv-" + (urlsplit(url).hostname or "env") if parts else "openenv-" + os.path.basename(spec.split(":")[0])[:-3]
    limit = session_limit(GenericEnvClient, url, sessions) if sessions > 1 else None
    return Environment(name, prompts, session, max_turns=int(opts.get("max_turns", 8)), close=close, max_sessions=limit)

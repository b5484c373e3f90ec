"""verifiers environments (PrimeIntellect's `verifiers`, its v1 stack: Env, Taskset, Harness, Episode) run by their
own episode loop, `--task verifiers:ID[?FIELD=VALUE&...]`: ID is a taskset (or environment) package verifiers
imports (an Environments Hub package installed with pip or `prime env install`, or one on PYTHONPATH), and
each FIELD=VALUE sets a field of its env config by its dotted path (`taskset.num_tasks=100`,
`player.max_turns=6`). Prompt index i is the taskset's task i; each round runs G episodes of each leased task
with `Env.run_episode`, concurrently, on an event loop in a thread of its own.

The env's agents get verifiers' train client (`TrainClientConfig`) pointed at the worker's loopback generate
endpoint (generate_server.py): the client renders the conversation to token ids with the model's
`renderers` and asks `/inference/v1/generate`, which the worker's engine answers from the main thread,
batching the calls that arrive together. The episode is rebuilt from the endpoint's record of the trace's
calls (generate_server.episode_of): the first call's prompt is the group's shared prompt, each later call must
extend what came before (else: drift, not trained), and what it adds is the environment's (mask 0). The reward
is the trace's (the sum of its rewards); an episode that failed (a harness or provider error) is not trained.
Agents run with the `null` harness (verifiers' own chat program, run by `uv`) in a local subprocess runtime,
unless the spec says otherwise.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from urllib.parse import parse_qsl

from env_types import Session, Step, require
from episodes import Episode
from generate_server import GenerateServer, episode_of

log = logging.getLogger("rollout.verifiers")


class Recorded(Session):
    """A verifiers episode's session: it ran already; the runner only reads its reward."""

    def __init__(self, reward: float, parts: dict[str, float]):
        self.reward, self.parts = reward, parts

    def step(self, text: str) -> Step:
        return Step([], done=True)

    def score(self) -> tuple[float, dict[str, float]]:
        return self.reward, self.parts


def set_path(cfg: dict, dotted: str, value: str) -> None:
    *head, last = dotted.split(".")
    for k in head:
        cfg = cfg.setdefault(k, {})
    cfg[last] = int(value) if value.lstrip("-").isdigit() else value


def episode_error(ep) -> str:
    """Why a verifiers episode failed: its traces' errors first (a model call's failure, such as the renderer
    refusing the model name, is recorded on the trace, not on the episode), then the episode's own."""
    errors = [err for t in ep.traces for err in t.errors] + list(ep.errors)
    if not errors:
        return "no model call was made"
    said = f"{errors[0].type}: {errors[0].message}"
    if "does not support tools" in said:  # verifiers' fallback for a model it does not know (SmolLM2): no tools
        said += f" (a taskset with tools needs a renderer that parses tool calls: {RENDERER_HINT})"
    return said[:500]


RENDERER_HINT = "verifiers:ID?renderer.tool_parser=qwen3, or ?renderer=NAME (docs/environments.md#the-libraries)"


def renderer_config(spec: str, given: dict[str, str]):
    """The renderer of verifiers' train client (TrainClientConfig.renderer, renderers' RendererConfig) from the spec's
    `renderer=NAME` and `renderer.FIELD=VALUE`; None when none is given (verifiers picks one by the model, and for a
    model it does not know, SmolLM2 included, that is its default renderer, which renders no tools). `tool_parser`
    alone means the default renderer with that parser (the local model's own chat template, tool calls parsed)."""
    if not given:
        return None
    from typing import get_args

    from pydantic import TypeAdapter, ValidationError
    from renderers.configs import RendererConfig
    from renderers.parsers import TOOL_PARSERS
    names = [c.model_fields["name"].default for c in get_args(get_args(RendererConfig)[0])]
    cfg = {"name": "default", **given}
    if cfg["name"] not in names:
        raise SystemExit(f"verifiers:{spec}: no renderer {cfg['name']!r}; renderers: {', '.join(names)}")
    if cfg.get("tool_parser") not in (None, *TOOL_PARSERS):
        raise SystemExit(f"verifiers:{spec}: no tool parser {cfg['tool_parser']!r}; tool parsers: {', '.join(TOOL_PARSERS)}")
    try:
        return TypeAdapter(RendererConfig).validate_python(cfg)
    except ValidationError as e:
        raise SystemExit(f"verifiers:{spec}: renderer {cfg}: {e.errors()[0]['msg']} "
                         f"({'.'.join(map(str, e.errors()[0]['loc'][1:])) or 'name'})") from None


class VerifiersEnvironment:
    """A verifiers env, its tasks by index, and the loopback endpoint its agents generate through."""

    def __init__(self, spec: str, renderer_model: str, generate, max_model_len: int, temperature: float,
                 max_new_tokens: int, max_turns: int, max_tokens: int):
        require("verifiers", "verifiers.v1")
        import verifiers.v1 as vf
        from verifiers.v1.utils.loaders import environment_class, import_taskset
        # the null harness's chat program runs under uv: the one beside this interpreter first
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        ident, _, query = spec.partition("?")
        try:
            import_taskset(ident)  # (environment_class falls back to a bare env when it does not import)
            cls = environment_class(ident)
        except ModuleNotFoundError as e:
            raise SystemExit(f"verifiers:{ident}: {e} Install its package (pip install, or prime env install "
                             f"OWNER/{ident}), or put it on PYTHONPATH.") from None
        except (TypeError, AttributeError, ValueError) as e:
            raise SystemExit(f"verifiers:{ident}: {e}") from None
        cfg_type = next((b.__args__[0] for b in getattr(cls, "__orig_bases__", ()) if getattr(b, "__args__", None)),
                        vf.SingleAgentEnvConfig)
        raw: dict = {"taskset": {"id": ident}}
        for role, f in cfg_type.model_fields.items():  # every agent role: a local subprocess, verifiers' chat program
            if f.annotation is vf.AgentConfig:
                raw[role] = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"},
                             **({"max_turns": max_turns} if max_turns else {})}
        pairs = parse_qsl(query)
        renderer = renderer_config(spec, {("name" if k == "renderer" else k[len("renderer."):]): v
                                          for k, v in pairs if k == "renderer" or k.startswith("renderer.")})
        for k, v in pairs:
            if not (k == "renderer" or k.startswith("renderer.")):
                set_path(raw, k, v)
        self.env = cls(cfg_type.model_validate(raw))
        if not self.env.taskset.bounded:
            raise SystemExit(f"verifiers:{spec}: the taskset is infinite; bound it (taskset.num_tasks=N)")
        self.tasks = list(self.env.taskset)
        self.name, self.prompts = f"verifiers-{ident}", self.tasks  # prompt index i: task i
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.version = 0
        self.server = GenerateServer(generate, "policy", max_model_len, version=lambda: self.version)
        url = self.server.start()
        os.environ["ASYNC_GRPO_LOOPBACK_KEY"] = self.server.key
        self.ctx = vf.ModelContext(model="policy", client=vf.TrainClientConfig(
            base_url=url + "/v1", api_key_var="ASYNC_GRPO_LOOPBACK_KEY", renderer_model_name=renderer_model,
            renderer=renderer),
            sampling=vf.SamplingConfig(temperature=temperature, max_tokens=max_new_tokens))
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.serving = self.env.serving()  # verifiers' shared servers (interception) for the worker's life
        asyncio.run_coroutine_threadsafe(self.serving.__aenter__(), self.loop).result()

    def run(self, idx: list[int], G: int, version: int) -> tuple[list[list[int]], list[Episode]]:
        """G episodes of each task in `idx`; (each group's shared prompt ids, the episodes group-major)."""
        self.version = version

        async def all_of():
            return await asyncio.gather(*[self.env.run_episode(self.tasks[i], self.ctx) for i in idx for _ in range(G)])
        fut = asyncio.run_coroutine_threadsafe(all_of(), self.loop)
        self.server.serve_batches(fut.done)  # the engine answers the agents' calls here, in this thread
        runs = fut.result()
        prompts, eps = [], []
        for j, i in enumerate(idx):
            group = runs[j * G:(j + 1) * G]
            calls = [self.server.calls.take(t.id) for ep in group for t in ep.traces[:1]]
            firsts = [c[0].prompt_ids for c in calls if c]
            shared = max(set(map(tuple, firsts)), key=firsts.count) if firsts else ()
            prompts.append(list(shared))
            for ep, cs in zip(group, calls + [[]] * (len(group) - len(calls))):
                eps.append(self._episode(i, ep, cs, list(shared)))
        return prompts, eps

    def _episode(self, i: int, ep, calls, shared: list[int]) -> Episode:
        trace = ep.traces[0] if ep.traces else None
        reward = float(trace.reward) if trace is not None else 0.0
        parts = {k: float(r.value) for k, r in (trace.rewards.items() if trace else ()) if r is not None}
        e = Episode(i, Recorded(reward, parts))
        if calls:
            e.tokens, e.mask, e.logprobs, e.versions, e.drift = episode_of(calls, shared)
        e.turns, e.tool_turns = len(calls), max(0, len(calls) - 1)
        e.finish = "length" if calls and calls[-1].finish == "length" else "stop"
        e.reward, e.parts = reward, {"correct": reward, **{f"diag_{k}": v for k, v in parts.items()}}
        if len(ep.traces) > 1:
            e.failed = f"the episode has {len(ep.traces)} traces; only single-agent episodes are trained"
        if len(e.tokens) > self.max_tokens:  # the proxy would refuse the group: say so here
            e.failed = f"the episode has {len(e.tokens)} tokens, more than --max-episode-tokens {self.max_tokens}"
        if not ep.ok or not calls or 1 not in e.mask:
            e.failed = f"the verifiers episode did not complete: {episode_error(ep)}"
        return e

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.serving.__aexit__(None, None, None), self.loop).result(30)
        except Exception as e:  # noqa: BLE001 - stopping anyway
            log.info(f"verifiers: stopping its servers: {e}")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.server.stop()

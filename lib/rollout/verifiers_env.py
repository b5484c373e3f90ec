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
extend what came before (else: drift, not trained), and what it adds is the environment's (mask 0). For a model
verifiers has no renderer of its own for (SmolLM2, any fine-tune) the client gets vf_renderer's, which extends the
sampled token ids turn by turn rather than re-render the history from text. The reward is the trace's (the sum of
its rewards; its `@vf.metric`s are reported beside them); an episode that failed (a harness or provider error) is
not trained. The sampling each episode had is the endpoint's record of its calls (an env's own `sampling` merges
over the worker's --temperature), and what the engine cannot honour is refused (generate_server.sampling_problem).
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
from generate_server import GenerateServer, episode_of, not_honoured, sampling_problem

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


def renderer_config(spec: str, given: dict[str, str], model: str):
    """The renderer of verifiers' train client (TrainClientConfig.renderer, renderers' RendererConfig) from the spec's
    `renderer=NAME` and `renderer.FIELD=VALUE`. No name given: the renderer verifiers would pick by the model, except
    that for a model it has none of its own for (SmolLM2, any fine-tune: its default renderer, the model's chat template,
    which renders no tools) it is vf_renderer's, which renders later turns from the sampled tokens; `tool_parser` alone
    means that one with the parser (tool calls parsed). `renderer=default` is verifiers' own default renderer, which
    renders each turn's history from text (and drifts where sampled ids are not their text's tokenisation)."""
    from renderers.base import MODEL_RENDERER_MAP
    from vf_renderer import bridge_config
    if not given:
        return None if model in MODEL_RENDERER_MAP else bridge_config()
    from typing import get_args

    from pydantic import TypeAdapter, ValidationError
    from renderers.configs import DefaultRendererConfig, RendererConfig
    from renderers.parsers import TOOL_PARSERS
    names = [c.model_fields["name"].default for c in get_args(get_args(RendererConfig)[0])]
    cfg = {"name": "default", **given}
    if cfg["name"] not in names:
        raise SystemExit(f"verifiers:{spec}: no renderer {cfg['name']!r}; renderers: {', '.join(names)}")
    if cfg.get("tool_parser") not in (None, *TOOL_PARSERS):
        raise SystemExit(f"verifiers:{spec}: no tool parser {cfg['tool_parser']!r}; tool parsers: {', '.join(TOOL_PARSERS)}")
    try:
        config = TypeAdapter(RendererConfig).validate_python(cfg)
    except ValidationError as e:
        raise SystemExit(f"verifiers:{spec}: renderer {cfg}: {e.errors()[0]['msg']} "
                         f"({'.'.join(map(str, e.errors()[0]['loc'][1:])) or 'name'})") from None
    return bridge_config(config) if "name" not in given and isinstance(config, DefaultRendererConfig) else config


def check_sampling(spec: str, env, run_sampling, temperature: float) -> None:
    """Refuse at start an agent whose sampling (its env config's, merged over the worker's as verifiers merges it)
    the loopback endpoint would refuse on every call; say where an agent asks for what is served but not honoured
    (a seed: generate_server.not_honoured) and where it samples at another temperature than --temperature (its groups are sent, and trained, at the temperature they were sampled at)."""
    from verifiers.v1.configs.agent import agent_config_fields, resolve_agent
    for role, agent in agent_config_fields(env.config).items():
        if agent.client is not None or agent.model is not None:
            continue  # not the policy: it does not generate through the worker
        sp = resolve_agent(agent, sampling=run_sampling).sampling.model_dump(exclude_none=True)
        if why := sampling_problem(sp):
            raise SystemExit(f"verifiers:{spec}: the agent {role!r} cannot sample as its env configures it "
                             f"({role}.sampling, over --temperature): {why}")
        if said := not_honoured(sp):
            log.warning(f"verifiers:{spec}: the agent {role!r} ({role}.sampling): {said}")
        if sp.get("temperature", 1.0) != temperature:
            log.info(f"verifiers: the agent {role!r} samples at temperature {sp.get('temperature', 1.0)} (its env's own "
                     f"sampling), not --temperature {temperature}; its groups are sent and trained at that temperature")


def one_temperature(eps: list[Episode]) -> None:
    """The trainer scores a group at one temperature: an episode sampled at another than its group's first
    (an env whose sampling differs by episode) fails, and its group is not sent."""
    temps = [e.sampling["temperature"] for e in eps if e.sampling]
    for e in eps:
        if e.sampling and e.sampling["temperature"] != temps[0] and not e.failed:
            e.failed = (f"it was sampled at temperature {e.sampling['temperature']}, its group's first episode at "
                        f"{temps[0]}: a group is trained at one temperature")


def trace_parts(trace) -> dict[str, float]:
    """A trace's reward components and metrics (`@vf.reward`, `@vf.metric`, record_reward/record_metric), as the
    group's reward components: `diag_NAME` each (a metric named like a reward: `diag_metric_NAME`); one that did not
    run (None) is left out."""
    parts = {f"diag_{k}": float(r.value) for k, r in trace.rewards.items() if r is not None}
    for k, v in trace.metrics.items():
        if v is not None:
            parts[f"diag_metric_{k}" if f"diag_{k}" in parts else f"diag_{k}"] = float(v)
    return parts


def group_calls(group: list, calls) -> list[list]:
    """Each episode's model calls (generate_server.Calls, taken): its first trace's; none for an episode that has
    no trace (it failed before its first turn), so that each of its group-mates still gets its own."""
    return [calls.take(ep.traces[0].id) if ep.traces else [] for ep in group]


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
                                          for k, v in pairs if k == "renderer" or k.startswith("renderer.")},
                                   renderer_model)
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
        check_sampling(spec, self.env, self.ctx.sampling, temperature)
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
            calls = group_calls(group, self.server.calls)
            firsts = [c[0].prompt_ids for c in calls if c]
            shared = max(set(map(tuple, firsts)), key=firsts.count) if firsts else ()
            prompts.append(list(shared))
            built = [self._episode(i, ep, cs, list(shared)) for ep, cs in zip(group, calls)]
            one_temperature(built)
            eps += built
        sessions, n = self.server.calls.drop_all()  # every episode of the round is over: what is left, none trains
        if sessions:
            log.info(f"verifiers: {n} model call(s) of {sessions} trace(s) no episode is built from (another agent's, "
                     f"or made outside an episode) dropped")
        return prompts, eps

    def _episode(self, i: int, ep, calls, shared: list[int]) -> Episode:
        trace = ep.traces[0] if ep.traces else None
        reward = float(trace.reward) if trace is not None else 0.0
        parts = trace_parts(trace) if trace is not None else {}
        e = Episode(i, Recorded(reward, parts))
        if calls:
            e.tokens, e.mask, e.logprobs, e.versions, e.drift = episode_of(calls, shared)
            temps = sorted({c.temperature for c in calls})
            e.sampling = {"temperature": temps[0], "top_p": 1.0}
            if len(temps) > 1:
                e.failed = f"its model calls were sampled at temperatures {temps}: a group is trained at one temperature"
        e.turns, e.tool_turns = len(calls), max(0, len(calls) - 1)
        e.finish = "length" if calls and calls[-1].finish == "length" else "stop"
        e.reward, e.parts = reward, {"correct": reward, **parts}
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

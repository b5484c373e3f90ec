"""The episode runner: G episodes per prompt, a model turn, then the environment's turn, until the
environment says done or a turn or token budget is reached. rollout.py and evaluate.py both run
episodes through `run_episodes`; the environments are in lib/shared/environments.py, the engines'
turn samplers in hf_engine.py (`HFTurns`) and engines.py (`TokenTurns`).

The token sequence of an episode is built up turn by turn and never re-tokenised (`Episode`): what the
engine sampled is appended with its behaviour logprob and the adapter version that sampled it (mask 1),
and what the environment says next is rendered by the chat template on its own (`Renderer.after_turn`:
the end of the model's turn the template adds, the new messages, the next assistant header) and
appended as environment tokens (mask 0, logprob null). So the trainer scores exactly the tokens the
policy sampled, in exactly the context it sampled them in.

An environment that keeps the whole conversation itself hands its history back with each step; the
runner renders that history and checks it against the tokens it has (`Renderer.drift`). A chat template
can render a history differently from what was sampled (a re-tokenised turn, whitespace stripped, a
reasoning block dropped); such an episode is counted (`drift`) and its group is not trained: training on
tokens the model never saw in that context, silently, is what this check exists to prevent.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from chat_render import Renderer
from environments import Environment, Session

log = logging.getLogger("rollout.episodes")


@dataclass
class Budget:
    max_turns: int = 4          # model turns per episode
    max_new_tokens: int = 24    # tokens per model turn
    max_tokens: int = 256       # tokens per episode after the shared prompt: sampled and environment tokens


@dataclass
class Episode:
    """One episode's append-only token sequence after the group's shared prompt."""
    prompt_index: int
    session: Session
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)  # [[first token index, version], ...]
    turns: int = 0
    tool_turns: int = 0          # environment turns (the environment answered and the episode went on)
    finish: str | None = None    # stop | length | turns, once it ended
    drift: str | None = None     # why the environment's history does not match the tokens (None: it does)
    failed: str | None = None    # why the episode did not complete (an environment library's error)
    texts: list[str] = field(default_factory=list)  # the model's turns, decoded (for the log and evaluate.py)
    reward: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # the reward's components (environments.Session.score)
    sampling: dict = field(default_factory=dict)  # what a library's own loop sampled it with (verifiers); {}: --temperature

    def add_sampled(self, ids: list[int], lps: list[float], version: int) -> None:
        if ids and (not self.versions or self.versions[-1][1] != version):
            self.versions.append([len(self.tokens), version])
        self.tokens += ids
        self.mask += [1] * len(ids)
        self.logprobs += list(lps)

    def add_environment(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [None] * len(ids)

    def completion(self, reward: float) -> dict:
        """The episode in the group schema (common.Completion): a single-turn episode as before (no mask),
        `versions` only when more than one adapter version sampled it."""
        c = {"token_ids": self.tokens, "logprobs": self.logprobs, "reward": reward, "finish_reason": self.finish}
        if 0 in self.mask:
            c["mask"] = self.mask
        if len(self.versions) > 1:
            c["versions"] = self.versions
        return c


def open_episode(env: Environment, i: int) -> Episode:
    """An episode of prompt i with a fresh session; one whose session cannot be opened (a server that refuses
    it, say) is failed at once: its group is dropped, the round and the worker go on."""
    try:
        return Episode(i, env.session(i))
    except Exception as err:  # noqa: BLE001 - whatever the environment's library raises
        return Episode(i, Session(), finish="stop",
                       failed=f"its session could not be opened: {type(err).__name__}: {err}"[:500])


def score(e: Episode) -> None:
    """The episode's reward from its session; a scorer that raises fails the episode (its group is dropped)."""
    try:
        e.reward, e.parts = e.session.score()
    except Exception as err:  # noqa: BLE001 - the environment's scorer
        e.failed = f"the environment's scorer failed: {type(err).__name__}: {err}"[:500]


def waves(n: int, G: int, limit: int | None) -> list[tuple[int, int, int]]:
    """How a round of n prompts, G episodes each, runs with at most `limit` sessions open at once (None: no
    limit): (first prompt, prompts, episodes per prompt) of each wave, in order, so that the episodes come out
    group-major as one wave's would. limit >= G: whole groups, limit // G of them a wave; else each group in
    waves of `limit` episodes."""
    if limit is None or limit >= n * G:
        return [(0, n, G)]
    if limit >= G:
        per = limit // G
        return [(j, min(per, n - j), G) for j in range(0, n, per)]
    return [(j, 1, min(limit, G - k)) for j in range(n) for k in range(0, G, limit)]


def run_in_waves(turns, env: Environment, indices: list[int], prompts: list[list[int]], G: int, budget: Budget,
                 renderer: Renderer, version: int, swap: Callable[[], int | None] | None = None) -> list[Episode]:
    """run_episodes, with at most env.max_sessions sessions open at once (an OpenEnv server's limit): the rest
    wait for a later wave. A round of several waves takes no new version before its end (swap unused): the
    first tokens of every wave must be sampled by the round's version, the version its groups are sent at."""
    plan = waves(len(indices), G, env.max_sessions)
    if len(plan) == 1:
        return run_episodes(turns, env, indices, prompts, G, budget, renderer, version, swap)
    return [e for first, n, g in plan for e in run_episodes(turns, env, indices[first:first + n],
                                                             prompts[first:first + n], g, budget, renderer, version)]


def run_episodes(turns, env: Environment, indices: list[int], prompts: list[list[int]], G: int, budget: Budget,
                 renderer: Renderer, version: int, swap: Callable[[], int | None] | None = None) -> list[Episode]:
    """G episodes for each prompt (group-major, as the engines' sample()), run to their end. `turns` is an
    engine's turn sampler: start(prompts, G) once, then turn({episode: tokens to append}, {episode: max
    new tokens}) -> {episode: (token_ids, logprobs, finish_reason)} for the episodes still running, and
    rebuild() after the weights changed. `version` samples the first turn; swap(), called between two turns,
    returns the version it has just loaded (None: none), which samples from the next turn on (each token
    records its version: Episode.versions)."""
    eps = [open_episode(env, i) for i in indices for _ in range(G)]
    max_turns = min(budget.max_turns, env.max_turns) if env.max_turns else budget.max_turns
    turns.start(prompts, G)
    feed: dict[int, list[int]] = {k: [] for k, e in enumerate(eps) if not e.failed}
    try:
        while feed:
            if swap is not None and any(e.turns for e in eps) and (new := swap()) is not None:
                version = new
                turns.rebuild()
            room = {k: min(budget.max_new_tokens, budget.max_tokens - len(eps[k].tokens)) for k in feed}
            got = turns.turn(feed, room)
            feed = {}
            for k, (ids, lps, fin) in got.items():
                e = eps[k]
                e.add_sampled(ids, lps, version)
                e.turns += 1
                text = renderer.tok.decode(ids, skip_special_tokens=True)
                e.texts.append(text)
                try:
                    step = e.session.step(text)
                except Exception as err:  # noqa: BLE001 - the environment's code or server failed this episode
                    e.failed, e.finish = f"the environment's step failed: {type(err).__name__}: {err}"[:500], "stop"
                    continue
                if step.mismatch:  # the environment says the episode is not the one these tokens are
                    e.drift, e.finish = step.mismatch, "stop"
                    continue
                if step.done:
                    e.finish = "stop" if fin == "stop" else "length"
                    continue
                if e.turns >= max_turns:
                    e.finish = "turns"
                    continue
                env_ids = renderer.after_turn(step.messages, ids[-1] if ids else None)
                if len(e.tokens) + len(env_ids) >= budget.max_tokens:
                    e.finish = "length"  # no room for the environment's answer and a model turn after it
                    continue
                e.add_environment(env_ids)
                e.tool_turns += 1
                if step.history is not None and (why := renderer.drift(step.history, prompts[k // G] + e.tokens)):
                    e.drift, e.finish = why, "stop"
                    continue
                feed[k] = env_ids
        for e in eps:  # scored while the environment is still there (a server's session, say)
            if not e.failed:
                score(e)
    finally:
        for e in eps:
            e.session.close()
    return eps


def group_sampling(eps: list[Episode]) -> dict:
    """The group's meta from its episodes' own sampling (verifiers: what the loopback endpoint generated its calls
    with): the temperature they were sampled at (the trainer scores the group at it) and each episode's sampling,
    in completion order; {} where the worker's --temperature sampled them."""
    if not any(e.sampling for e in eps):
        return {}
    return {"temperature": next(e.sampling["temperature"] for e in eps if e.sampling),
            "sampling": [e.sampling for e in eps]}


def group_of(eps: list[Episode]) -> tuple[list[dict], list[dict], str | None]:
    """The G episodes of one prompt scored by their environment: (completions in the group schema, reward
    components, why the group must not be trained: an episode drifted; None: it may)."""
    comps, parts = [], []
    for e in eps:
        comps.append(e.completion(e.reward))
        parts.append({**e.parts, "diag_turns": float(e.turns)})
    why = next((f"episode {k}: {e.drift or e.failed}" for k, e in enumerate(eps) if e.drift or e.failed), None)
    return comps, parts, why

"""What the trainer's audit can re-check of a participant's group, by the kind of the run's --task (docs/trust.md):

  single-turn (tasks.py:      prompt: the chat-formatted prompt it was leased; reward: the task's reward of the
  addition, gsm8k, ...)       completion's decoded text (a completion with environment tokens fails)
  calculator,                 prompt: the environment's first messages of that prompt, rendered; reward: the episode
  reasoning-gym:NAME          replayed (`replay`): each model turn, decoded, is given to a fresh session of the
                              environment, whose answers must be the environment tokens the episode has, rendered as
                              the runner renders them (a forged tool result fails), and its score must be the reward
  openenv:..., verifiers:...  neither: their sessions are a server's or a library's own loop (a server's state, a
                              server this trainer would have to start, the worker's own engine), not replayed here.
                              What remains: the proxy's checks on arrival (the group answers a lease of the run's open
                              dataset, once, and is no replay) and the behaviour logprobs, recomputed as for any task

`audited(name, tok)` gives the one for --task: `.name` and `.size` (the dataset the run's workers lease), then
`prompt_ids(i)` and `rescore(completion, i)`; an environment whose library is missing here is audited as the last
kind, said once.
"""
from __future__ import annotations

from chat_render import Renderer
from common import sampled_mask
from environments import Environment, is_environment, load_environment
from models import encode_prompt
from tasks import Task, load_task

UNREPLAYED = ("openenv", "verifiers")  # environments whose episodes the audit does not replay (above)


class SingleTurn:
    """A tasks.py task: its prompts and its reward of a completion's text."""

    def __init__(self, task: Task, tok):
        self.task, self.tok, self.name, self.size = task, tok, task.name, len(task.prompts)

    def prompt_ids(self, i: int) -> list[int]:
        return encode_prompt(self.tok, self.task.prompts[i])

    def rescore(self, c: dict, i: int) -> tuple[float | None, str | None]:
        """(the task's reward of the completion, None), or (None, why it cannot be this task's)."""
        if 0 in sampled_mask(c):
            return None, f"it has environment tokens, but task {self.name} is single-turn"
        return self.task.reward(self.tok.decode(c["token_ids"], skip_special_tokens=True), i)[0], None


def turns_of(c: dict) -> list[tuple[list[int], list[int]]]:
    """An episode's tokens as (model turn, environment tokens after it) pairs, in order (the last one's environment
    tokens empty): the runner appends a model turn's sampled tokens (mask 1), then the environment's answer (mask 0)."""
    out: list[tuple[list[int], list[int]]] = []
    for tok, m in zip(c["token_ids"], sampled_mask(c)):
        if not out or (m and out[-1][1]):  # the first token, or a sampled one after environment tokens: a new turn
            out.append(([], []))  # (an episode that begins with environment tokens has an empty first turn)
        out[-1][0 if m else 1].append(tok)
    return out


class Replayed:
    """An environment whose episodes replay here (calculator, reasoning-gym): its first messages and its sessions."""

    def __init__(self, env: Environment, tok):
        self.env, self.tok, self.name, self.size = env, tok, env.name, len(env.prompts)
        self.renderer = Renderer(tok, set())
        self.ending: dict[int, Renderer] = {}  # by a turn's last token: the renderer that takes it as the turn's EOS

    def prompt_ids(self, i: int) -> list[int]:
        return self.renderer.ids(self.env.prompts[i])

    def answers(self, messages: list[dict], last: int | None) -> list[list[int]]:
        """The environment tokens the runner appends after a model turn ending in `last`: the template's end of turn,
        less the EOS the model sampled itself when it ended the turn with one (which tokens are EOS is the engine's
        to say: both are accepted; neither changes what the environment said), then `messages`, then the next header."""
        plain = self.renderer.after_turn(messages, None)
        if last is None:
            return [plain]
        r = self.ending.setdefault(last, Renderer(self.tok, {last}))
        return [plain, r.after_turn(messages, last)]

    def rescore(self, c: dict, i: int) -> tuple[float | None, str | None]:
        """(the environment's score of the episode replayed, None), or (None, where the episode is not one the
        environment gives)."""
        pairs = turns_of(c)
        if not pairs[0][0]:
            return None, "it begins with environment tokens, not a model turn"
        if self.env.max_turns and len(pairs) > self.env.max_turns:
            return None, f"it has {len(pairs)} model turns; environment {self.name} allows {self.env.max_turns}"
        session = self.env.session(i)
        try:
            for k, (ids, after) in enumerate(pairs):
                step = session.step(self.tok.decode(ids, skip_special_tokens=True))
                if k == len(pairs) - 1:
                    break
                if step.done or step.mismatch:
                    return None, f"the environment ends the episode after model turn {k + 1}; it goes on"
                if after not in (want := self.answers(step.messages, ids[-1])):
                    return None, (f"the environment tokens after model turn {k + 1} are not the environment's answer: "
                                  f"{self.tok.decode(after)[:200]!r}, where it answers {self.tok.decode(want[0])[:200]!r}")
            return session.score()[0], None
        finally:
            session.close()


class Unreplayed:
    """A library environment (openenv, verifiers; or one whose library is missing here): nothing of its task is
    re-checked (the module's docstring); `why` says so in the trainer's log."""

    def __init__(self, why: str):
        self.name, self.size, self.why = None, None, why  # the dataset: the one the run's own workers open

    def prompt_ids(self, i: int) -> None:
        return None

    def rescore(self, c: dict, i: int) -> tuple[None, None]:
        return None, None


def audited(name: str, tok) -> SingleTurn | Replayed | Unreplayed:
    """The run's --task as the audit checks it (the module's docstring)."""
    if not is_environment(name):
        return SingleTurn(load_task(name), tok)
    if name.split(":", 1)[0] in UNREPLAYED:
        return Unreplayed(f"task {name}'s episodes are not replayed here (a server's or a library's own loop): "
                                "participants' prompts and rewards are not re-checked, their behaviour logprobs are")
    try:
        return Replayed(load_environment(name), tok)
    except SystemExit as e:  # its library is not installed here (environments.require says which)
        return Unreplayed(f"task {name} does not load here ({e}): participants' prompts and rewards are not "
                                "re-checked, their behaviour logprobs are")

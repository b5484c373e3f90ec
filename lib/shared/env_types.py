"""What an environment is (environments.py's contract, apart from the environments themselves, so that an adapter in
a module of its own, openenv_env.py, imports this and environments.py imports the adapter, with no circle):
`Environment` (the first messages of each prompt, a `Session` per episode), `Step` (what a session answers a
model turn with), and `require` (an optional library, or a clear error naming it)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Step:
    messages: list[dict]                  # what the environment says next (chat messages; empty when done)
    done: bool
    history: list[dict] | None = None     # the whole conversation as the environment keeps it, if it does
    mismatch: str | None = None           # the environment found its episode is not the one the tokens say


class Session:
    """One episode's environment: step() takes the text of the model's turn; score() its reward at the end."""

    def step(self, text: str) -> Step:
        raise NotImplementedError

    def score(self) -> tuple[float, dict[str, float]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


@dataclass
class Environment:
    name: str
    prompts: list[list[dict]]             # the first chat messages of each prompt index (the shared prompt)
    session: Callable[[int], Session]     # a fresh session for an episode of prompt i
    max_turns: int = 4                    # model turns per episode (the runner's default turn budget)
    close: Callable[[], None] = field(default=lambda: None)  # stops whatever the environment started
    max_sessions: int | None = None       # sessions it allows open at once (None: no limit); the rest wait


def require(package: str, module: str | None = None):
    """Import an optional environment library, or stop naming the package and how to install it."""
    try:
        return importlib.import_module(module or package.replace("-", "_"))
    except ImportError as e:
        raise SystemExit(f"this task needs the package {package!r}, which is not installed ({e}): "
                         f"pip install -r requirements-envs.txt (or launch with --rollout-with envs)") from e

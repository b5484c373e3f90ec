"""An OpenEnv environment server for the tests, made with openenv-core's own server classes: guess the number.
reset(seed) picks a number from 1 to 20 by the seed; each action is a guess in text; the observation says
'higher', 'lower' or 'right' and the number of guesses left; reward 1 for the right guess; done when it is
right or after 4 guesses. `app` allows 128 sessions at once; `one_session` is the library's default (one) and
its game fails every step of seed 1; `nan_reward` rewards seed 2 with NaN; `optional_text` says its game (by the
seed) in an Optional[str] field; `mcp` takes openenv's MCP action (CallToolAction) instead of a guess.

    python -m uvicorn openenv_guess:app --app-dir tests/support --port 8001
"""
import random
import re
from typing import Optional
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

GUESSES = 4


class GuessAction(Action):
    guess: str = Field(..., description="the guess, as text; its first number counts")


class GuessObservation(Observation):
    feedback: str = Field(default="", description="what the game says")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.secret = 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.secret = random.Random(seed).randint(1, 20)
        return GuessObservation(feedback=f"I am thinking of a number from 1 to 20. Guess it: reply with just a "
                                         f"number. You have {GUESSES} guesses.", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        m = re.search(r"-?\d+", action.guess)
        left = GUESSES - self._state.step_count
        if m and int(m.group()) == self.secret:
            return GuessObservation(feedback="right", done=True, reward=1.0)
        hint = "not a number" if not m else "higher" if int(m.group()) < self.secret else "lower"
        return GuessObservation(feedback=f"{hint}; {left} guesses left", done=left <= 0, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=128)


class FlakyGuessEnvironment(GuessEnvironment):
    """The game whose step fails for seed 1 (prompt index 1): a server's error on one episode must drop that
    group only, never end the worker."""

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.seed = seed
        return super().reset(seed, episode_id, **kwargs)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        if self.seed == 1:
            raise RuntimeError("the game broke")
        return super().step(action, timeout_s, **kwargs)


# openenv-core's defaults, as `openenv init` writes them: one session at a time
one_session = create_app(FlakyGuessEnvironment, GuessAction, GuessObservation, env_name="guess")


class NanGuessEnvironment(GuessEnvironment):
    """The game whose reward is NaN for seed 2 (a scorer's 0/0): that group must be dropped, said, never trained."""

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.seed = seed
        return super().reset(seed, episode_id, **kwargs)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        got = super().step(action, timeout_s, **kwargs)
        return got.model_copy(update={"reward": float("nan")}) if self.seed == 2 else got


nan_reward = create_app(NanGuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=128)


class NotedObservation(Observation):
    """An observation whose text is optional (pydantic's Optional[str]: anyOf string, null in the schema)."""
    note: Optional[str] = Field(default=None, description="what the game says")


class SeededGuessEnvironment(GuessEnvironment):
    """The game whose first observation names its game (by the seed), in an optional text field."""

    def reset(self, seed=None, episode_id=None, **kwargs) -> NotedObservation:
        first = super().reset(seed, episode_id, **kwargs)
        return NotedObservation(note=f"Game {seed}. {first.feedback}", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> NotedObservation:
        got = super().step(action, timeout_s, **kwargs)
        return NotedObservation(note=got.feedback, done=got.done, reward=got.reward)


optional_text = create_app(SeededGuessEnvironment, GuessAction, NotedObservation, env_name="guess",
                           max_concurrent_envs=128)
# an MCP environment's action (a tool's name and its arguments): no model turn can drive it
mcp = create_app(GuessEnvironment, CallToolAction, CallToolObservation, env_name="guess-mcp", max_concurrent_envs=128)

"""A multi-turn game as a verifiers (v1) environment, for the tests: guess the number. The env's run() plays the
other side, as verifiers' own OpenEnv taskset does: each model turn is a guess, the game answers 'higher',
'lower' or 'right' as the next user turn; reward 1 for a right guess within 4."""
import random
import re

import verifiers.v1 as vf

GUESSES = 4


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData]):
    pass


class GuessConfig(vf.TasksetConfig):
    num_tasks: int = 50


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> list[GuessTask]:
        return [GuessTask(GuessData(idx=i, prompt=None, secret=random.Random(i).randint(1, 20)), self.config.task)
                for i in range(self.config.num_tasks)]


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        right = 0.0
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn("I am thinking of a number from 1 to 20. Reply with just a number.")
            for left in range(GUESSES - 1, -1, -1):
                if segment.terminated:
                    break
                m = re.search(r"-?\d+", segment.last_reply or "")
                if m and int(m.group()) == task.data.secret:
                    right = 1.0
                    break
                if left == 0:
                    break
                hint = "not a number" if not m else "higher" if int(m.group()) < task.data.secret else "lower"
                segment = await interaction.turn(f"{hint}; {left} guesses left")
        interaction.trace.record_reward("guessed", right)


__all__ = ["GuessTaskset", "GuessEnv"]

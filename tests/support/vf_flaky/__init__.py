"""vf_guess's game, for the tests, where the first `fail_first` episodes this process plays fail before their first turn
(as one whose box could not be provisioned does): they have no trace, the episodes after them do."""
import verifiers.v1 as vf
from vf_guess import GuessEnv, GuessEnvConfig, GuessTaskset


class FlakyConfig(GuessEnvConfig):
    fail_first: int = 0


class FlakyGuessEnv(GuessEnv, vf.Env[FlakyConfig]):
    started = 0

    async def run(self, task, agents):
        FlakyGuessEnv.started += 1
        if FlakyGuessEnv.started <= self.config.fail_first:
            raise RuntimeError(f"episode {FlakyGuessEnv.started} could not be provisioned")
        await super().run(task, agents)


__all__ = ["GuessTaskset", "FlakyGuessEnv"]

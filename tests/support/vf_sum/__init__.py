"""A single-turn verifiers (v1) taskset for the tests: what is a + b, scored by an exact match of the reply, and a
metric (the reply's length) beside the reward."""
import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def exact_match(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == str(self.data.answer))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:  # recorded, not part of the reward
        return float(len(trace.last_reply or ""))


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 50


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        return [SumTask(SumData(idx=i, prompt=f"What is {i} + {i % 7}? Reply with just the number.", answer=i + i % 7),
                        self.config.task) for i in range(self.config.num_tasks)]


__all__ = ["SumTaskset"]

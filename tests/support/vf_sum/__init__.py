"""A single-turn verifiers (v1) taskset, the verifiers twin of the local `addition` demo: what is a + b for single
digits, rewarded when the last number in the reply is the sum (`3 + 4 = 7.` counts, as the demo's reward counts it,
so the default 135M model gets groups whose rewards differ, and learns); the bare number (`exact_match`) and the
reply's length are metrics beside the reward."""
import random
import re

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)

    @vf.metric
    async def exact_match(self, trace: vf.Trace) -> float:  # recorded, not part of the reward
        return float((trace.last_reply or "").strip().rstrip(".") == str(self.data.answer))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 80


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        pairs = [(a, b) for a in range(10) for b in range(10)]
        random.Random(0).shuffle(pairs)
        return [SumTask(SumData(idx=i, prompt=f"What is {a} + {b}? Answer with just the number.", answer=a + b),
                        self.config.task) for i, (a, b) in enumerate(pairs[:self.config.num_tasks])]


__all__ = ["SumTaskset"]

"""A single-turn verifiers (v1) taskset for the tests whose reward raises on task 1 (a rubric that breaks on one
input): that task's episodes fail with the rubric's error and its group is dropped; the other tasks' score."""
import verifiers.v1 as vf


class AskData(vf.TaskData):
    answer: int


class AskTask(vf.Task[AskData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.idx == 1:
            raise ValueError("the rubric cannot read task 1's answer")
        return float(str(self.data.answer) in (trace.last_reply or ""))


class AskConfig(vf.TasksetConfig):
    num_tasks: int = 4


class AskTaskset(vf.Taskset[AskTask, AskConfig]):
    def load(self) -> list[AskTask]:
        return [AskTask(AskData(idx=i, prompt=f"What is {i} + 1?", answer=i + 1), self.config.task)
                for i in range(self.config.num_tasks)]


__all__ = ["AskTaskset"]

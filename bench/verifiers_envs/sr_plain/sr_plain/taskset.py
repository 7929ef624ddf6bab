import verifiers.v1 as vf


class SrPlainData(vf.TaskData):
    """One row: a sum and its answer."""

    answer: str = ""


class SrPlainTask(vf.Task[SrPlainData]):
    """Rewards, hooks, and servers, with row data available on ``self.data``."""

    @vf.reward(weight=1.0)
    async def reward(self, trace: vf.Trace) -> float:
        content = trace.last_message.content if trace.messages else ""
        return float(self.data.answer in str(content or ""))


class SrPlainConfig(vf.TasksetConfig):
    num_tasks: int = 5
    """How many tasks to build."""


class SrPlainTaskset(vf.Taskset[SrPlainTask, SrPlainConfig]):
    def load(self) -> list[SrPlainTask]:
        return [
            SrPlainTask(SrPlainData(prompt=f"What is {i} + {i + 3}?", answer=str(2 * i + 3)))
            for i in range(self.config.num_tasks)
        ]

import verifiers.v1 as vf

from sr_arith.servers.tool import SrArithToolset


class SrArithData(vf.TaskData):
    """One row: a sum and its answer."""

    answer: str = ""


class SrArithTaskConfig(vf.TaskConfig):
    """Knobs the task reads from ``self.config``; configure them under ``--env.taskset.task.*``."""

    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class SrArithTask(vf.Task[SrArithData, vf.State, SrArithTaskConfig]):
    """Rewards, hooks, and servers, with row data available on ``self.data``."""

    @classmethod
    def toolsets(cls, config: SrArithTaskConfig) -> list[vf.Toolset]:
        return [SrArithToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def reward(self, trace: vf.Trace) -> float:
        content = trace.last_message.content if trace.messages else ""
        return float(self.data.answer in str(content or ""))


class SrArithConfig(vf.TasksetConfig):
    num_tasks: int = 5
    """How many tasks to build."""
    task: SrArithTaskConfig = SrArithTaskConfig()


class SrArithTaskset(vf.Taskset[SrArithTask, SrArithConfig]):
    def load(self) -> list[SrArithTask]:
        return [
            SrArithTask(
                SrArithData(prompt=f"What is {i} + {i + 3}? Use the tool.", answer=str(2 * i + 3)), self.config.task
            )
            for i in range(self.config.num_tasks)
        ]

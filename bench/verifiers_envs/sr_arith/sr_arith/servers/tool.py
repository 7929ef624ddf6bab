import verifiers.v1 as vf


class SrArithToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "sr_arith"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


if __name__ == "__main__":
    SrArithToolset.run()

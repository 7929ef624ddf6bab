from sr_arith.taskset import SrArithTaskset

__all__ = ["SrArithTaskset"]

from sr_plain.taskset import SrPlainTaskset

__all__ = ["SrPlainTaskset"]

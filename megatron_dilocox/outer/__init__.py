"""DiLoCoX outer loop in plain torch: outer optimizer and round-boundary sync."""
from megatron_dilocox.outer.optimizer import OuterNesterov
from megatron_dilocox.outer.sync import ByteCounter, OuterSync, RoundStats, allreduce_mean

__all__ = ["ByteCounter", "OuterNesterov", "OuterSync", "RoundStats", "allreduce_mean"]

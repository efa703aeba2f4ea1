"""megarl: a Megatron-native, monolithic SPMD trainer for RLHF and RLVR (PPO, GRPO)."""

__version__ = "0.1.0"

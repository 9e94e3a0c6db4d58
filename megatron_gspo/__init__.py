"""megatron_gspo: GSPO reinforcement-learning post-training for Mixture-of-Experts LLMs on
Megatron-Core, with SGLang rollouts and GRPO + Routing Replay as the baseline."""

__version__ = "0.1.0"

"""Reward functions, the worker pool that calls them, and the code-execution sandbox.
No Megatron or torch import (worker processes stay light).

The trainer's calls::

    runner = RewardRunner(config.reward)            # resolves names; unknown ones fail here
    result = runner.score([RewardInput(prompt=..., response=..., answer=..., metadata=...,
                                       prompt_ids=..., response_ids=...), ...])
    result.rewards   # [B] floats;  result.metrics: reward_mean, reward_errors, ...
    runner.close()
"""

from megatron_gspo.reward.functions import (
    BUILTIN_REWARDS,
    RewardInput,
    RewardSpec,
    load_reward_function,
    reward_specs,
)
from megatron_gspo.reward.judge import (
    JudgeBackend,
    JudgeReply,
    JudgeReward,
    parse_judgement,
    render_judge_prompt,
)
from megatron_gspo.reward.runner import RewardFailure, RewardResult, RewardRunner
from megatron_gspo.reward.sandbox import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    run_python,
)

__all__ = [
    "BUILTIN_REWARDS",
    "JudgeBackend",
    "JudgeReply",
    "JudgeReward",
    "RewardFailure",
    "RewardInput",
    "RewardResult",
    "RewardRunner",
    "RewardSpec",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "load_reward_function",
    "parse_judgement",
    "render_judge_prompt",
    "reward_specs",
    "run_python",
]

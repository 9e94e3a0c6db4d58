"""The CPU tool-use task: multiply two 4-digit numbers with a calculator that runs in the sandbox.

A tiny model cannot multiply 4-digit numbers, but it can learn to call the tool and copy its
answer. On the synthetic tokenizer with tool tokens (``data.task=multiply``,
:data:`megatron_gspo.data.tokenizer.TOOL_TOKENS`), an ideal episode is::

    prompt        3 1 4 1 * 5 9 2 6 <sep>
    turn 0        <call> 3 1 4 1 * 5 9 2 6 </call>            (the turn ends at </call>)
    observation   <result> 1 8 6 1 3 5 6 6 </result>          (the calculator's output)
    turn 1        1 8 6 1 3 5 6 6 <eos>                        (the answer ends the episode)

The calculator is a Python program run by :func:`megatron_gspo.envs.tools.run_tool` in the code
sandbox with the expression between the turn's last ``<call>`` and its ``</call>`` as input; a
malformed expression makes it fail, and the observation is ``<result> <error> </result>``
(counted as a failed tool call). A turn that ends at ``<eos>`` is the answer, scored like the
digit tasks (:func:`megatron_gspo.data.synthetic.score_digit_response`: per answer position 1
for the right digit, 0.1 for a wrong one) and the episode ends. A successful call can earn
``call_reward`` (0 by default: only the answer counts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from megatron_gspo.data.synthetic import score_digit_response
from megatron_gspo.data.tokenizer import EOS_TOKEN_ID, SEP_TOKEN_ID, TOOL_TOKENS
from megatron_gspo.envs.base import Environment, EnvStart, EnvStep, Turn
from megatron_gspo.envs.tools import check_tool_sandbox, run_tool, tool_limits

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt

STAR, CALL, CALL_END = TOOL_TOKENS["*"], TOOL_TOKENS["<call>"], TOOL_TOKENS["</call>"]
RESULT, RESULT_END, ERROR = (
    TOOL_TOKENS["<result>"],
    TOOL_TOKENS["</result>"],
    TOOL_TOKENS["<error>"],
)

CALCULATOR = r"""
import sys

expression = sys.stdin.read().strip()
left, star, right = expression.partition("*")
if not (star and left.isdigit() and right.isdigit() and len(left) <= 12 and len(right) <= 12):
    sys.exit(f"the calculator multiplies two whole numbers (like 1234*5678), got {expression!r}")
print(int(left) * int(right))
"""
"""The tool: one product of two whole numbers, read from standard input."""


def expression_text(token_ids: list[int]) -> str:
    """The call's expression as text: digits and ``*``; any other token becomes ``?`` (which
    the calculator rejects)."""
    return "".join(
        str(token) if 0 <= token <= 9 else "*" if token == STAR else "?" for token in token_ids
    )


class MultiplyToolEnvironment(Environment):
    """The episode of the module docstring. Options: the calculator's sandbox limits
    (``tool_timeout_s``, ``tool_memory_mb``, ``isolation``) and ``call_reward``."""

    def __init__(
        self,
        *,
        tokenizer: Any = None,
        tool_timeout_s: float = 5.0,
        tool_memory_mb: int = 256,
        isolation: str = "bubblewrap",
        call_reward: float = 0.0,
    ):
        del tokenizer  # the task's token ids are fixed
        self.limits = tool_limits(
            tool_timeout_s=tool_timeout_s,
            tool_memory_mb=tool_memory_mb,
            isolation=isolation,
            key="env.options",
        )
        self.call_reward = float(call_reward)
        self.prompt: Optional[Prompt] = None

    @classmethod
    def check(cls, isolation: str = "bubblewrap", **_other_options: Any) -> None:
        check_tool_sandbox(isolation)

    def reset(self, prompt: Prompt) -> EnvStart:
        if prompt.answer is None or STAR not in prompt.prompt_ids:
            raise ValueError(
                f"{prompt.source}: the multiply_tool environment needs the multiply task's "
                "prompts (data.task=multiply)"
            )
        self.prompt = prompt
        return EnvStart(context_ids=list(prompt.prompt_ids), stop_token_ids=[CALL_END])

    def step(self, turn: Turn) -> EnvStep:
        ids = [int(token) for token in turn.token_ids]
        if ids and ids[-1] == CALL_END:
            start = max((i for i, token in enumerate(ids) if token == CALL), default=-1) + 1
            result = run_tool(CALCULATOR, stdin=expression_text(ids[start:-1]), limits=self.limits)
            output = result.output.strip()
            if result.failed or not output.isdigit():
                return EnvStep(
                    observation_ids=[RESULT, ERROR, RESULT_END],
                    tool_calls=1,
                    tool_failures=1,
                    tool_timeouts=int(result.status == "timeout"),
                )
            return EnvStep(
                observation_ids=[RESULT, *(int(c) for c in output), RESULT_END],
                reward=self.call_reward,
                tool_calls=1,
            )
        return EnvStep(reward=score_digit_response(ids, self.prompt.answer), done=True)

    def demonstration(self) -> list[list[int]]:
        prompt_ids = list(self.prompt.prompt_ids)
        operands = prompt_ids[: prompt_ids.index(SEP_TOKEN_ID)]
        return [
            [CALL, *operands, CALL_END],
            [*(int(c) for c in self.prompt.answer), EOS_TOKEN_ID],
        ]

"""Tools run in the code sandbox, and the built-in Python tool environment.

A tool call is a program run by :func:`megatron_gspo.reward.sandbox.run_python`: a child
process confined by bubblewrap (no network, a read-only file system, its own PID namespace,
time, memory, process and output limits; docs/code-sandbox.md). :func:`run_tool` never raises
for what the program does: a program that raises, exits non-zero, runs out of time or memory
returns a :class:`ToolResult` whose status says so and whose text is the error the model sees.
Environments count them (``EnvStep.tool_failures``, ``tool_timeouts``; the run's
``env/tool_failures``, ``env/tool_timeouts``, ``env/tool_success_frac``).

Where the kernel cannot isolate code, the environments' start-up ``check`` stops the run
(``isolation=none`` is the opt-out for trusted programs only), as the code reward does.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from megatron_gspo.config import ConfigError
from megatron_gspo.envs.base import Environment, EnvStart, EnvStep, Turn
from megatron_gspo.reward.sandbox import (
    ISOLATION_MODES,
    SandboxLimits,
    SandboxUnavailableError,
    check_isolation,
    run_python,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_gspo.data.prompts import Prompt

TOOL_STATUSES = ("ok", "error", "timeout")


@dataclass(frozen=True)
class ToolResult:
    """How one tool call ended."""

    status: str
    """``ok``, ``error`` (raised, exited non-zero, ran out of memory or CPU time) or
    ``timeout`` (stopped by its wall-clock limit)."""
    output: str
    """Standard output (ok), or the error for the model: the last line of standard error, or
    what stopped the program."""

    @property
    def failed(self) -> bool:
        return self.status != "ok"


def run_tool(
    program: str, *, stdin: str = "", limits: SandboxLimits, max_output_chars: int = 1000
) -> ToolResult:
    """Run ``program`` in the sandbox with ``stdin``; its outcome (module docstring). Raises
    only :class:`SandboxUnavailableError` (the kernel cannot isolate code here)."""
    result = run_python(program, stdin=stdin, limits=limits)
    if result.timed_out:
        return ToolResult("timeout", f"timed out after {limits.wall_time_s:g} s")
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        if result.memory_exceeded:
            message = f"MemoryError (the limit is {limits.memory_mb} MB)"
        elif result.cpu_time_exceeded:
            message = f"CPU time limit of {limits.cpu_time_s} s exceeded"
        else:
            message = lines[-1] if lines else f"exited with status {result.returncode}"
        return ToolResult("error", message[-max_output_chars:])
    return ToolResult("ok", result.stdout[:max_output_chars])


def tool_limits(
    *, tool_timeout_s: float, tool_memory_mb: int, isolation: str, key: str
) -> SandboxLimits:
    """The sandbox limits of a tool environment's options (``key``: the options' config key,
    for errors)."""
    if isolation not in ISOLATION_MODES:
        raise ConfigError(
            f"{key}.isolation",
            f"{isolation!r} is not one of {list(ISOLATION_MODES)}",
            "tool programs run under bubblewrap, or without isolation when they are trusted",
            "set isolation=bubblewrap (the default), or none for trusted programs only",
        )
    if not tool_timeout_s > 0 or not tool_memory_mb > 0:
        raise ConfigError(
            key,
            f"tool_timeout_s={tool_timeout_s}, tool_memory_mb={tool_memory_mb}",
            "they are the limits of each tool call",
            "set both > 0",
        )
    return SandboxLimits(
        wall_time_s=float(tool_timeout_s),
        cpu_time_s=max(1, int(tool_timeout_s + 0.999)),
        memory_mb=int(tool_memory_mb),
        isolation=isolation,
    )


def check_tool_sandbox(isolation: str, key: str = "env.options") -> None:
    """A :class:`ConfigError` at start when ``isolation=bubblewrap`` cannot isolate code here
    (the run would otherwise fail every tool call)."""
    if isolation != "bubblewrap":
        return
    try:
        check_isolation()
    except SandboxUnavailableError as error:
        raise ConfigError(
            f"{key}.isolation",
            "the code sandbox cannot isolate the environment's tool programs on this machine",
            str(error),
            "install bubblewrap and allow unprivileged user namespaces (docs/code-sandbox.md), "
            f"or set {key}.isolation=none if every program the tool runs is trusted",
        ) from None


# --------------------------------------------------------------------------------------------
# The Python tool: the model writes code, the sandbox runs it, the output comes back
# --------------------------------------------------------------------------------------------

# One lock for the tokenizer calls of the environments' threads: a Hugging Face fast tokenizer
# may refuse concurrent use ("Already borrowed"); the tool programs themselves run in parallel.
_TOKENIZER_LOCK = threading.Lock()


class PythonToolEnvironment(Environment):
    """The model may run Python: a turn holding ``call_start`` code ``call_end`` (by default
    ``<code>...</code>``) gets the program's standard output (or its error) back, framed by
    ``observation_template``; a turn without code is the answer and ends the episode. Rewards
    come from the reward functions (``reward.functions``, e.g. ``math`` on the last turn's
    boxed answer), which see the whole response.

    A turn ends at the tokenizer's EOS and at the tokens of ``stop_tokens`` (their strings,
    e.g. ``["<|im_end|>"]``; each must be one token of the vocabulary). Each call runs with
    ``tool_timeout_s``, ``tool_memory_mb`` and ``isolation`` (the sandbox's limits).
    """

    def __init__(
        self,
        *,
        tokenizer: PreTrainedTokenizerBase,
        call_start: str = "<code>",
        call_end: str = "</code>",
        observation_template: str = "\n<output>\n{output}\n</output>\n",
        stop_tokens: Optional[list[str]] = None,
        tool_timeout_s: float = 5.0,
        tool_memory_mb: int = 512,
        isolation: str = "bubblewrap",
        max_output_chars: int = 1000,
    ):
        self.tokenizer = tokenizer
        self.pattern = re.compile(re.escape(call_start) + r"(.*?)" + re.escape(call_end), re.S)
        self.observation_template = observation_template
        self.limits = tool_limits(
            tool_timeout_s=tool_timeout_s,
            tool_memory_mb=tool_memory_mb,
            isolation=isolation,
            key="env.options",
        )
        self.max_output_chars = max_output_chars
        self.stop_token_ids = []
        for token in stop_tokens or []:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
                raise ConfigError(
                    "env.options.stop_tokens",
                    f"{token!r} is not a token of the tokenizer",
                    "a turn can only end at a single token id",
                    "list tokens of the vocabulary (special tokens such as '<|im_end|>')",
                )
            self.stop_token_ids.append(int(token_id))

    @classmethod
    def check(cls, isolation: str = "bubblewrap", **_other_options: Any) -> None:
        check_tool_sandbox(isolation)

    def reset(self, prompt: Prompt) -> EnvStart:
        return EnvStart(context_ids=list(prompt.prompt_ids), stop_token_ids=self.stop_token_ids)

    def step(self, turn: Turn) -> EnvStep:
        with _TOKENIZER_LOCK:
            text = self.tokenizer.decode(list(turn.token_ids), skip_special_tokens=True)
        calls = self.pattern.findall(text)
        if not calls:
            return EnvStep(done=True)
        result = run_tool(calls[-1], limits=self.limits, max_output_chars=self.max_output_chars)
        shown = result.output if not result.failed else f"Error: {result.output}"
        observation = self.observation_template.format(output=shown.rstrip("\n"))
        with _TOKENIZER_LOCK:
            observation_ids = self.tokenizer.encode(observation, add_special_tokens=False)
        return EnvStep(
            observation_ids=observation_ids,
            tool_calls=1,
            tool_failures=int(result.failed),
            tool_timeouts=int(result.status == "timeout"),
        )

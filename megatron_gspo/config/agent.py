"""The agent section of the configuration (``agent.*``): episodes run by a user's agent function
through the OpenAI-compatible endpoint (docs/agentic.md, "Agents through the OpenAI-compatible
endpoint"); part of the one configuration tree, :mod:`megatron_gspo.config`, whose rules hold
here: every default lives here once, with its source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_gspo.config.schema import ConfigError, check_positive

TOOL_CALL_FORMATS = ("hermes", "none")
"""How the endpoint reads tool calls in the model's text (megatron_gspo/rollout/tool_calls.py)."""


@dataclass
class AgentConfig:
    """A user's agent program as the rollout source: for each sample the trainer opens a session
    on its chat endpoint and calls ``agent.function``, which runs the episode with any OpenAI
    client and returns the reward."""

    function: Optional[str] = None
    """Import path ``package.module:function`` of the agent, called as ``function(session)``
    with an ``AgentSession`` (base_url, api_key, headers, the prompt) and returning a float
    reward, to which reward.functions' weighted score of the episode is added when any are set;
    null: no agent."""
    max_turns: int = 8
    """Most model calls of an episode (verl's multi_turn.max_assistant_turns); a later request
    of the session is refused (409) and the episode is truncated."""
    max_tokens_per_turn: Optional[int] = None
    """Most tokens of one model turn (a request's max_tokens may lower it); null: what is left
    of algo.response_length, the budget of the tokens after the first context."""
    num_workers: int = 8
    """Episodes (agent functions) running at the same time, in threads of the driver."""
    tool_call_format: str = "hermes"
    """How tool calls are parsed from the model's text: hermes (Qwen 2.5/3, Hermes: <tool_call>
    JSON </tool_call>, as SGLang's and vLLM's hermes parsers), or none."""
    stop_tokens: list[str] = field(default_factory=lambda: ["<|im_end|>"])
    """Tokens that end a model turn besides EOS: the chat template's end of turn (ChatML's
    <|im_end|>); each must be one token of the tokenizer."""
    per_turn_samples: bool = False
    """One training sample per model turn (its context and its tokens) instead of one per
    episode, for agents that rewrite their context between turns; every sample of an episode
    gets the episode's advantage (algo.advantage_level=turn: its turn's). A whole-episode sample
    needs every turn to extend the previous context: an episode that rewrote it is kept out of
    the loss (agent/rewritten_episodes) unless this is on."""

    def __post_init__(self) -> None:
        check_positive("agent.max_turns", self.max_turns)
        check_positive("agent.num_workers", self.num_workers)
        if self.max_tokens_per_turn is not None:
            check_positive("agent.max_tokens_per_turn", self.max_tokens_per_turn)
        if self.tool_call_format not in TOOL_CALL_FORMATS:
            raise ConfigError(
                "agent.tool_call_format",
                f"{self.tool_call_format!r} is not a known format",
                "the endpoint parses tool calls in a named format",
                f"choose one of {list(TOOL_CALL_FORMATS)}",
            )

"""Tool calls in a model's text, by named format (the chat endpoint's ``tool_call_format``).

``hermes`` (Qwen 2.5/3, Hermes, NousResearch's function-calling format; SGLang's and vLLM's
``hermes``/``qwen25`` parsers read the same): each call is one JSON object between tags, the
rest of the text is the message's content::

    Let me compute that.
    <tool_call>
    {"name": "multiply", "arguments": {"a": 3141, "b": 5926}}
    </tool_call>

A block whose JSON does not parse, or has no string ``name``, is not a call: it stays in the
content, as the model wrote it, so the agent sees what the model produced (and the trajectory,
which keeps the model's tokens, is unaffected either way). An opening tag without its closing
tag (a turn cut by a limit) is left in the content too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from megatron_gspo.config.agent import TOOL_CALL_FORMATS

# TOOL_CALL_FORMATS: ``none`` does no parsing (the whole text is the content).

_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One function call: its name and its arguments as a JSON object string (OpenAI's form)."""

    name: str
    arguments: str


def parse_tool_calls(text: str, tool_call_format: str) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of a model turn's text in ``tool_call_format`` (module docstring):
    the content is the text without the parsed call blocks, stripped."""
    if tool_call_format == "none":
        return text, []
    if tool_call_format != "hermes":
        raise ValueError(f"tool_call_format {tool_call_format!r} is not one of {TOOL_CALL_FORMATS}")
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _HERMES_BLOCK.finditer(text):
        call = _hermes_call(match.group(1))
        if call is None:
            continue  # not a call: the block stays in the content
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    return "".join(kept).strip(), calls


def _hermes_call(body: str) -> ToolCall | None:
    try:
        value: Any = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        # Some models write the arguments as a JSON string already; OpenAI's field is one.
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))

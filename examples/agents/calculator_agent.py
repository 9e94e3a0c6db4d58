"""An agent written only against the ``openai`` client: it answers an arithmetic question, may
call a calculator tool, and gets a second try after a wrong answer.

Train a policy through it (docs/agentic.md, "Agents through the OpenAI-compatible endpoint")::

    python -m megatron_gspo.train agent.function=examples.agents.calculator_agent:run_episode ...

The trainer calls :func:`run_episode` once per sample with a session (``session.base_url``,
``session.api_key``, ``session.headers``, ``session.prompt``, ``session.answer``); everything
else is the agent's own business. Like any harness, it sends the whole conversation back each
turn; the endpoint appends only the new messages' tokens.
"""

from __future__ import annotations

import json
import re

import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
MAX_TURNS = 3
_ARITHMETIC = re.compile(r"[0-9+\-*/(). ]+")


def calculate(arguments: str) -> str:
    """The calculator tool: the value of the expression, or an error text for the model."""
    try:
        expression = str(json.loads(arguments)["expression"])
    except (ValueError, KeyError, TypeError):
        return 'error: arguments must be {"expression": "..."}'
    if not _ARITHMETIC.fullmatch(expression) or "**" in expression:  # no powers: no huge numbers
        return "error: only numbers, + - * / and parentheses"
    try:
        return str(eval(expression, {"__builtins__": {}}, {}))  # noqa: S307 - checked above
    except Exception as error:  # a malformed expression is the model's mistake, not ours
        return f"error: {type(error).__name__}"


def score(text: str, answer: str) -> float:
    """1 for the right number in the reply; otherwise a small part for writing digits at all
    (a signal a freshly initialised model can climb)."""
    if answer and re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", text):
        return 1.0
    return 0.1 * sum(character.isdigit() for character in text) / max(len(text), 1)


def run_episode(session) -> float:
    client = openai.OpenAI(
        base_url=session.base_url,
        api_key=session.api_key,
        default_headers=session.headers,
        max_retries=0,
    )
    messages = [{"role": "user", "content": session.prompt}]
    reward = 0.0
    for _ in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR]
            )
        except openai.APIStatusError as error:
            if error.status_code == 409:  # the session's budget or turns are spent
                break
            raise
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.message.tool_calls:
            for call in choice.message.tool_calls:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": calculate(call.function.arguments),
                    }
                )
            continue
        reward = score(choice.message.content or "", session.answer or "")
        if reward == 1.0:
            break
        messages.append({"role": "user", "content": "That is not right. Try again."})
    return reward

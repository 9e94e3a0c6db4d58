"""An agent that rewrites its context between turns, written only against the ``openai`` client.

It answers an arithmetic question with a calculator tool, as ``calculator_agent.py`` does, but
keeps a bounded memory: after every turn it drops what the turn produced (its answer, the tool's
output) and keeps a one-line note instead, so each request is the question plus the notes so
far. Such a request does not extend the conversation the endpoint holds (the earlier answer is
gone): the endpoint renders it afresh (a rewrite), and the episode has no single token sequence.
Train it with per-turn samples, one sample per model turn (docs/agentic.md, "Per-turn
samples")::

    python -m megatron_gspo.train agent.function=examples.agents.note_taking_agent:run_episode \\
        agent.per_turn_samples=true ...

Without ``agent.per_turn_samples`` its multi-turn episodes are kept out of the loss
(``agent/rewritten_episodes``).
"""

from __future__ import annotations

import openai

from examples.agents.calculator_agent import CALCULATOR, calculate, score

MAX_TURNS = 3
NOTE_CHARACTERS = 40
"""A note quotes at most this much of an answer: a note is one short line."""


def one_line(text: str) -> str:
    """``text`` on one line, cut to ``NOTE_CHARACTERS``."""
    flat = " ".join(text.split())
    return flat if len(flat) <= NOTE_CHARACTERS else flat[:NOTE_CHARACTERS] + "..."


def converse(client: openai.OpenAI, question: str, answer: str) -> float:
    """One episode: at most ``MAX_TURNS`` model calls, each given the question and the notes
    (never the earlier turns themselves); the reward of the last answer."""
    notes: list[str] = []
    reward = 0.0
    for _ in range(MAX_TURNS):
        messages = [{"role": "user", "content": question}]
        if notes:
            # The rewrite: the earlier turns and tool outputs, each replaced by its note.
            messages.append({"role": "user", "content": "Notes: " + " | ".join(notes)})
        try:
            reply = client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR]
            )
        except openai.APIStatusError as error:
            if error.status_code == 409:  # the session's budget or turns are spent
                break
            raise
        message = reply.choices[0].message
        if message.tool_calls:
            for call in message.tool_calls:
                result = calculate(call.function.arguments)
                notes.append(
                    f"calculator({one_line(call.function.arguments)}) = {one_line(result)}"
                )
            continue
        text = message.content or ""
        reward = score(text, answer)
        if reward == 1.0:
            break
        notes.append(f"the answer {one_line(text)!r} was wrong")
    return reward


def run_episode(session) -> float:
    client = openai.OpenAI(
        base_url=session.base_url,
        api_key=session.api_key,
        default_headers=session.headers,
        max_retries=0,
    )
    return converse(client, session.prompt, session.answer or "")

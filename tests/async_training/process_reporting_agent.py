"""An agent (``agent.function``) whose reward is the id of the process that ran it: where agent
episodes ran. One model call per episode through the ``openai`` client."""

from __future__ import annotations

import os

import openai


def run_episode(session) -> float:
    client = openai.OpenAI(
        base_url=session.base_url,
        api_key=session.api_key,
        default_headers=session.headers,
        max_retries=0,
    )
    client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": session.prompt}]
    )
    return float(os.getpid())

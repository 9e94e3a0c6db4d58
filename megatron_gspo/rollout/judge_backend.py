"""A judge model's answers through its rollout engine: texts in, texts out, one batched
``generate`` call per round, with a time limit (the :class:`~megatron_gspo.reward.judge.
JudgeBackend` of the model-graded reward, ``reward.judge.*``).

The engine is the judge role's (``models.<role>``, :mod:`megatron_gspo.rollout.roles`): an
embedded transformers model in this process or SGLang servers; either way the call runs here, in
the driver's process, which owns the engine (docs/judges.md).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any, Optional

from megatron_gspo.config import ConfigError, JudgeConfig, TrainConfig
from megatron_gspo.reward.judge import JudgeReply
from megatron_gspo.rollout.types import GenerateRequest, GenerateResult, RolloutEngine

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
"""Files of which a saved tokenizer has at least one."""

ABORT_GRACE_S = 30.0
"""How long a timed-out call may take to hand back its aborted requests (an embedded engine
stops them at its next decode step, a server at its next scheduling step)."""


class EngineJudgeBackend:
    """Renders each judge prompt with the judge's tokenizer (its chat template when
    ``reward.judge.chat_template`` and the tokenizer has one), generates every answer in one
    ``engine.generate`` call, and decodes them (special tokens skipped).

    Time limit: the call runs in a helper thread; at ``timeout_s`` its requests are aborted
    through ``engine.abort`` (they finish with ``abort``) and count as ``timeout``; answers that
    finished before keep their text. A call that does not hand its requests back within
    :data:`ABORT_GRACE_S` after the abort is abandoned (every request a ``timeout``).
    """

    def __init__(self, engine: RolloutEngine, tokenizer: Any, judge: JudgeConfig):
        self.engine, self.tokenizer, self.judge = engine, tokenizer, judge
        self.stop_token_ids = tuple(
            sorted({t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None})
        )

    def encode(self, prompt: str) -> list[int]:
        """The judge's input ids of one rendered prompt."""
        if self.judge.chat_template and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            # transformers 5 returns a BatchEncoding; 4.x a list of ids.
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def complete(self, prompts: Sequence[str], timeout_s: float) -> list[JudgeReply]:
        if not prompts:
            return []
        try:
            requests = [
                GenerateRequest(
                    input_ids=self.encode(prompt),
                    max_new_tokens=self.judge.max_new_tokens,
                    temperature=self.judge.temperature,
                    stop_token_ids=self.stop_token_ids,
                    return_logprob=False,
                )
                for prompt in prompts
            ]
        except ValueError as error:  # e.g. a prompt that encodes to no token
            return [JudgeReply("error", message=f"cannot build the request: {error}")] * len(
                prompts
            )
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["results"] = self.engine.generate(requests)
            except Exception as error:  # reported per request below, never fatal to the run
                box["error"] = error

        thread = threading.Thread(target=run, name="judge-generate", daemon=True)
        thread.start()
        thread.join(timeout_s)
        timed_out = thread.is_alive()
        if timed_out:
            self.engine.abort([request.request_id for request in requests])
            thread.join(ABORT_GRACE_S)
            if thread.is_alive():
                logger.warning(
                    "judge: the engine did not hand back %d aborted requests within %g s; "
                    "the call is abandoned",
                    len(requests),
                    ABORT_GRACE_S,
                )
                return [JudgeReply("timeout", message="abandoned after the abort")] * len(prompts)
        if "error" in box:
            error = box["error"]
            return [JudgeReply("error", message=f"{type(error).__name__}: {error}")] * len(prompts)
        return [self._reply(result, timed_out) for result in box["results"]]

    def _reply(self, result: GenerateResult, timed_out: bool) -> JudgeReply:
        if result.finish_reason == "abort":
            if timed_out:
                return JudgeReply("timeout")
            return JudgeReply("error", message=f"aborted by the engine: {result.abort_message}")
        text = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        return JudgeReply("ok", text=text)


def load_judge_tokenizer(hf_path: str) -> Any:
    """The judge's own tokenizer, from its Hugging Face directory (``models.<role>.hf_path``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_path)


def build_judge_backend(
    cfg: TrainConfig, engines: dict[str, RolloutEngine]
) -> Optional[EngineJudgeBackend]:
    """The judge's backend over its role's engine (``engines``: the run's extra models' engines
    by role, :func:`megatron_gspo.rollout.roles.build_role_engines`); None without a judge."""
    judge = cfg.reward.judge
    if not judge.enabled:
        return None
    tokenizer = load_judge_tokenizer(cfg.models[judge.role].hf_path)
    return EngineJudgeBackend(engines[judge.role], tokenizer, judge)


def judge_start_problems(cfg: TrainConfig) -> list[ConfigError]:
    """What the judge needs before start and the configuration cannot say: a tokenizer in the
    judge's directory (the directory itself is :func:`~megatron_gspo.rollout.roles.
    role_start_problems`'s, the role's existence the configuration's)."""
    judge = cfg.reward.judge
    if not judge.enabled or judge.role not in cfg.models:
        return []
    hf_path = cfg.models[judge.role].hf_path
    if not hf_path or not os.path.isdir(hf_path):
        return []  # reported by the extra models' own checks
    key = f"models.{judge.role}.hf_path"
    missing = ConfigError(
        key,
        f"no tokenizer in {hf_path!r}",
        "the judge's prompts are encoded and its answers decoded with its own tokenizer",
        f"save the judge's tokenizer into {hf_path} (tokenizer.save_pretrained)",
    )
    # transformers 5 builds an empty tokenizer from a config.json alone, so look for its files.
    if not any(os.path.exists(os.path.join(hf_path, name)) for name in TOKENIZER_FILES):
        return [missing]
    try:
        tokenizer = load_judge_tokenizer(hf_path)
    except (OSError, ValueError) as error:
        return [
            ConfigError(
                key,
                f"no tokenizer can be loaded from {hf_path!r} ({type(error).__name__}: {error})",
                "the judge's prompts are encoded and its answers decoded with its own tokenizer",
                f"save the judge's tokenizer into {hf_path} (tokenizer.save_pretrained)",
            )
        ]
    if tokenizer.eos_token_id is None:
        return [
            ConfigError(
                key,
                "the judge's tokenizer has no eos token",
                "the judge's answer ends at its eos token (else it runs to "
                "reward.judge.max_new_tokens)",
                "use a tokenizer with an eos_token",
            )
        ]
    return []

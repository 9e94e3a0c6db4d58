"""The model-graded reward (``reward.judge.*``): a judge model, behind its own engine
(``models.<role>``), reads each sample through a template and answers with a verdict or a score.

Part of the one configuration tree, :mod:`megatron_gspo.config`, whose rules hold here: every
default lives here once, with its source. How the reward runs: :mod:`megatron_gspo.reward.judge`
and docs/judges.md.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_gspo.config.schema import (
    ConfigError,
    StartupErrors,
    check_choice,
    check_positive,
)

JUDGE_FORMATS = ("verdict", "score")
"""What ``reward.judge.format`` may name: ``verdict`` maps the answer's first word through
``reward.judge.verdicts``; ``score`` reads the answer's first number within
``[score_min, score_max]``."""
JUDGE_TEMPLATE_FIELDS = ("prompt", "response", "answer")
"""The fields a judge template may name: the sample's prompt text, its response text and the
data set's reference answer (:class:`megatron_gspo.reward.RewardInput`)."""

DEFAULT_JUDGE_TEMPLATE = (
    "Question:\n{prompt}\n\nReference answer:\n{answer}\n\nResponse:\n{response}\n\n"
    "Does the response reach the reference answer? Answer yes or no."
)


@dataclass
class JudgeConfig:
    """A model-graded reward: the judge's role, its prompt and how its answer becomes a score.
    Off while ``role`` is null."""

    role: Optional[str] = None
    """Role name of the judge model in ``models`` (e.g. ``judge`` with
    ``models.judge.hf_path=...``); null: no judge. Its score is added to the reward functions'
    weighted sum with ``weight``, reported as ``reward_judge_mean``."""
    weight: float = 1.0
    """Weight of the judge's score in the reward."""
    template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's prompt, with ``{prompt}``, ``{response}`` (required) and ``{answer}``
    replaced by the sample's texts (Python ``str.format`` fields; write ``{{`` for a brace). It
    goes through the judge tokenizer's chat template as one user message when
    ``chat_template`` is true."""
    chat_template: bool = True
    """Wrap the prompt in the judge tokenizer's chat template (one user turn, generation
    prompt added) when the tokenizer has one; false: the template's text is the whole prompt."""
    format: str = "verdict"
    """verdict: the answer's first word (letters and digits, case folded) looked up in
    ``verdicts``; score: the answer's first number, which must lie in [score_min, score_max],
    scaled to [0, 1]. Anything else is an unparsable answer: retried, then a failure."""
    verdicts: dict[str, float] = field(default_factory=lambda: {"yes": 1.0, "no": 0.0})
    """format=verdict: word -> score (keys are matched case-insensitively)."""
    score_min: float = 0.0
    """format=score: the lowest score the template asks for (scaled to 0)."""
    score_max: float = 1.0
    """format=score: the highest score the template asks for (scaled to 1), e.g. 10 for a
    '1 to 10' rubric."""
    max_new_tokens: int = 16
    """Longest answer the judge may write; the verdict or score must come first."""
    temperature: float = 0.0
    """Sampling temperature of the judge (0: greedy, the same answer for the same prompt)."""
    timeout_s: float = 120.0
    """Time limit of one batched call to the judge's engine; requests still running then are
    aborted and count as time-outs (retried while ``max_retries`` allows)."""
    max_retries: int = 1
    """A sample whose judgement failed (unparsable answer, engine error, time-out) is asked
    again, in one batched call per round, up to this many times; then it scores
    reward.failure_reward and is counted as a reward failure."""

    def __post_init__(self) -> None:
        errors = judge_problems(self)
        if errors:
            raise errors[0] if len(errors) == 1 else StartupErrors(errors)

    @property
    def enabled(self) -> bool:
        return self.role is not None


def template_fields(template: str) -> list[str]:
    """The field names ``template`` uses, in order (ValueError for a malformed template)."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def judge_problems(judge: JudgeConfig) -> list[ConfigError]:
    """Every problem of one ``reward.judge`` section that needs no other section."""
    errors: list[ConfigError] = []
    for check in (
        lambda: check_choice(
            "reward.judge.format", judge.format, JUDGE_FORMATS, "how the judge's answer is read"
        ),
        lambda: check_positive("reward.judge.max_new_tokens", judge.max_new_tokens),
        lambda: check_positive("reward.judge.timeout_s", judge.timeout_s),
        lambda: check_positive("reward.judge.max_retries", judge.max_retries, allow_zero=True),
        lambda: check_positive("reward.judge.temperature", judge.temperature, allow_zero=True),
    ):
        try:
            check()
        except ConfigError as error:
            errors.append(error)
    errors += _template_problems(judge.template)
    if judge.role is not None and not str(judge.role).isidentifier():
        errors.append(
            ConfigError(
                "reward.judge.role",
                f"role name {judge.role!r} is not an identifier",
                "the role names the judge's section, models.<role>",
                "use the key of the judge's section, e.g. reward.judge.role=judge",
            )
        )
    if judge.format == "verdict":
        errors += _verdict_problems(judge.verdicts)
    if judge.format == "score" and not judge.score_max > judge.score_min:
        errors.append(
            ConfigError(
                "reward.judge.score_max",
                f"score_max={judge.score_max} is not above score_min={judge.score_min}",
                "a score is scaled to [0, 1] by (score - score_min) / (score_max - score_min)",
                "set the range the template asks the judge for, e.g. score_min=1 score_max=10",
            )
        )
    return errors


def _template_problems(template: str) -> list[ConfigError]:
    try:
        fields = template_fields(template)
    except ValueError as error:
        return [
            ConfigError(
                "reward.judge.template",
                f"malformed template ({error})",
                "the template is filled with Python's str.format",
                "close every {field}, and write {{ and }} for literal braces",
            )
        ]
    errors = []
    unknown = [name for name in fields if name not in JUDGE_TEMPLATE_FIELDS]
    if unknown:
        errors.append(
            ConfigError(
                "reward.judge.template",
                f"unknown field(s) {', '.join('{' + name + '}' for name in unknown)}",
                f"a template can name only {', '.join(JUDGE_TEMPLATE_FIELDS)} (each sample's "
                "texts)",
                "use those fields, and write {{ and }} for literal braces",
            )
        )
    if "response" not in fields:
        errors.append(
            ConfigError(
                "reward.judge.template",
                "the template does not name {response}",
                "the judge grades the policy's response, which it must be shown",
                "put {response} in the template (with {answer} for the reference answer)",
            )
        )
    return errors


def _verdict_problems(verdicts: Any) -> list[ConfigError]:
    if not isinstance(verdicts, dict) or not verdicts:
        return [
            ConfigError(
                "reward.judge.verdicts",
                f"expected a non-empty mapping of words to scores, got {verdicts!r}",
                "format=verdict looks the judge's first word up in it",
                "e.g. reward.judge.verdicts={yes: 1.0, no: 0.0}",
            )
        ]
    errors = []
    bad_words = [word for word in verdicts if not str(word).isalnum()]
    if bad_words:
        errors.append(
            ConfigError(
                "reward.judge.verdicts",
                f"verdict(s) {bad_words} are not single words of letters and digits",
                "the judge's first word (letters and digits) is looked up",
                "use words such as yes, no, correct, incorrect, 1, 0",
            )
        )
    folded = [str(word).casefold() for word in verdicts]
    if len(set(folded)) != len(folded):
        errors.append(
            ConfigError(
                "reward.judge.verdicts",
                f"verdicts {list(verdicts)} repeat a word up to case",
                "words are matched case-insensitively",
                "keep one spelling of each word",
            )
        )
    for word, value in verdicts.items():
        if not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
            errors.append(
                ConfigError(
                    f"reward.judge.verdicts.{word}",
                    f"score {value!r} is not a finite number",
                    "the verdict's score is the sample's judge reward",
                    "give each verdict a number, e.g. yes: 1.0",
                )
            )
    return errors


def judge_role_problems(judge: JudgeConfig, models: dict[str, Any]) -> list[ConfigError]:
    """The judge's role must be one of the run's extra models (``models.<role>``)."""
    if judge.role is None or judge.role in models:
        return []
    return [
        ConfigError(
            "reward.judge.role",
            f"the judge role {judge.role!r} is not in models (roles: {sorted(models) or 'none'})",
            "the judge answers through its own engine, built from its models section",
            f"set models.{judge.role}.hf_path=/path/to/judge_hf_dir, or name an existing role",
        )
    ]

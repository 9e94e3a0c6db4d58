"""The built-in reward functions and resolving names / import paths / options."""

import pytest

from megatron_gspo.config import ConfigError
from megatron_gspo.data import build_synthetic_tokenizer
from megatron_gspo.reward import BUILTIN_REWARDS, RewardInput, RewardSpec, load_reward_function
from megatron_gspo.reward.math_answer import math_reward
from megatron_gspo.reward.synthetic import synthetic_reward
from megatron_gspo.reward.text import exact_match_reward, format_reward

USER_MODULE = f"{__name__.rpartition('.')[0]}.user_rewards".lstrip(".")


def sample(response: str, answer=None, **metadata) -> RewardInput:
    return RewardInput(prompt="question", response=response, answer=answer, metadata=metadata)


# ---------------------------------------------------------------------------------------------
# math


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("so the answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("the answer is $\\frac{2}{4}$", "0.5", 1.0),
        ("\\boxed{1/2}", "$\\frac{1}{2}$", 1.0),
        ("\\boxed{42}", "42", 1.0),
        ("I get 41, so \\boxed{41}", "42", 0.0),
        ("first 3, finally \\boxed{7}", "7", 1.0),  # the boxed answer wins over earlier numbers
        ("\\boxed{[0, 1)}", "[0, 1)", 1.0),  # a bare interval answer is read as LaTeX math
        ("\\boxed{(0, 1)}", "[0, 1)", 0.0),
        ("\\boxed{x^2 + 1}", "1 + x^2", 1.0),
        ("no idea", "42", 0.0),
    ],
)
def test_math_reward_checks_equivalence(response, answer, expected):
    assert math_reward(sample(response, answer)) == expected


def test_math_reward_require_boxed():
    assert math_reward(sample("the answer is 42", "42")) == 1.0
    assert math_reward(sample("the answer is 42", "42"), require_boxed=True) == 0.0
    assert math_reward(sample("\\boxed{42}", "42"), require_boxed=True) == 1.0


def test_math_reward_rejects_unusable_reference():
    with pytest.raises(ValueError, match="reference answer"):
        math_reward(sample("\\boxed{1}", None))
    with pytest.raises(ValueError, match="cannot parse the reference"):
        math_reward(sample("\\boxed{1}", "\\frac{"))


# ---------------------------------------------------------------------------------------------
# exact match and format


def test_exact_match_normalisation_options():
    assert exact_match_reward(sample("  Paris \n", "Paris")) == 1.0
    assert exact_match_reward(sample("New   York", "New York")) == 1.0
    assert exact_match_reward(sample("New   York", "New York"), normalize_whitespace=False) == 0.0
    assert exact_match_reward(sample("paris", "Paris")) == 0.0
    assert exact_match_reward(sample("paris", "Paris"), ignore_case=True) == 1.0


def test_exact_match_extracts_the_last_match_and_strips_special_tokens():
    response = "<answer>Lyon</answer> no wait <answer> Paris </answer><|im_end|>"
    pattern = r"<answer>(.*?)</answer>"
    assert exact_match_reward(sample(response, "Paris"), extract_pattern=pattern) == 1.0
    assert exact_match_reward(sample("Paris", "Paris"), extract_pattern=pattern) == 0.0
    assert exact_match_reward(sample("Paris<|im_end|>", "Paris")) == 0.0
    assert (
        exact_match_reward(sample("Paris<|im_end|>", "Paris"), special_tokens=["<|im_end|>"]) == 1.0
    )
    with pytest.raises(ValueError, match="needs an answer"):
        exact_match_reward(sample("Paris"))


def test_format_reward_default_think_answer_layout():
    assert format_reward(sample("<think>\n2+2=4\n</think>\n<answer>4</answer>")) == 1.0
    assert format_reward(sample("<answer>4</answer>")) == 0.0
    assert format_reward(sample("<think>x</think><answer>4</answer> trailing text")) == 0.0
    assert (
        format_reward(sample("<think>x</think><answer>4</answer> trailing"), full_match=False)
        == 1.0
    )
    assert (
        format_reward(sample("<think>x</think><answer>4</answer><eos>"), special_tokens=["<eos>"])
        == 1.0
    )


def test_format_reward_custom_pattern():
    assert format_reward(sample("Final: 12"), pattern=r"Final: \d+") == 1.0
    assert format_reward(sample("Final: twelve"), pattern=r"Final: \d+") == 0.0


# ---------------------------------------------------------------------------------------------
# synthetic


def test_synthetic_reward_uses_ids_and_falls_back_to_text():
    tokenizer = build_synthetic_tokenizer()
    response = "87654300<eos>"
    ids = tokenizer(response).input_ids
    with_ids = RewardInput(prompt="", response=response, answer="87654321", response_ids=ids)
    text_only = RewardInput(prompt="", response=response, answer="87654321")
    assert synthetic_reward(with_ids) == pytest.approx((6 + 0.1 + 0.1) / 8)
    assert synthetic_reward(text_only) == synthetic_reward(with_ids)
    with pytest.raises(ValueError, match="answer"):
        synthetic_reward(RewardInput(prompt="", response=response))


# ---------------------------------------------------------------------------------------------
# resolving names


def test_unknown_name_lists_the_valid_names():
    with pytest.raises(ConfigError) as raised:
        load_reward_function(RewardSpec("maths"))
    for name in BUILTIN_REWARDS:
        assert name in str(raised.value)
    assert "package.module:function" in str(raised.value)


def test_every_builtin_resolves():
    for name in BUILTIN_REWARDS:
        assert callable(load_reward_function(RewardSpec(name)))


def test_import_path_with_options():
    function = load_reward_function(
        RewardSpec(f"{USER_MODULE}:response_length", options={"scale": 2.0})
    )
    assert function(sample("abc")) == 6.0


def test_import_path_errors_are_config_errors():
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        load_reward_function(RewardSpec("no_such_module_xyz:score"))
    with pytest.raises(ConfigError, match="(?s)has no function 'missing'.*response_length"):
        load_reward_function(RewardSpec(f"{USER_MODULE}:missing"))
    with pytest.raises(ConfigError, match="(?s)unknown option.*'scal'.*valid options: scale"):
        load_reward_function(RewardSpec(f"{USER_MODULE}:response_length", options={"scal": 1}))
    with pytest.raises(ConfigError, match="valid options: ignore_case"):
        load_reward_function(RewardSpec("exact_match", options={"lower": True}))

"""Tools in the code sandbox: outcomes, error observations and their counts, the built-in tool
environments, and loading environments by name."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import ConfigError
from megatron_gspo.data import build_byte_tokenizer
from megatron_gspo.data.prompts import Prompt
from megatron_gspo.data.stream import synthetic_prompt
from megatron_gspo.data.synthetic import draw_digits
from megatron_gspo.data.tokenizer import EOS_TOKEN_ID, TOOL_TOKENS, build_synthetic_tokenizer
from megatron_gspo.envs import EnvironmentSpec, Turn, load_environment
from megatron_gspo.envs.multiply import MultiplyToolEnvironment
from megatron_gspo.envs.tools import PythonToolEnvironment, run_tool, tool_limits
from megatron_gspo.production.episodes import EpisodeSettings, demonstration_sample
from megatron_gspo.production.task import Task
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.samples import TrainSample
from megatron_gspo.trainer.stages import _padded_turns

from .conftest import environment_producer, isolated_or_fail_closed, train_config
from .scripted import ToolScriptEnvironment

LIMITS = tool_limits(tool_timeout_s=2.0, tool_memory_mb=256, isolation="bubblewrap", key="test")
UNHURRIED = tool_limits(tool_timeout_s=60.0, tool_memory_mb=256, isolation="bubblewrap", key="test")
CALL, CALL_END, RESULT, RESULT_END, ERROR = (
    TOOL_TOKENS[name] for name in ("<call>", "</call>", "<result>", "</result>", "<error>")
)


@pytest.mark.parametrize(
    "program, status, output",
    [
        ("print(6 * 7)", "ok", "42\n"),
        ("raise ValueError('no such thing')", "error", "ValueError: no such thing"),
        ("import time\ntime.sleep(30)", "timeout", "timed out after 2 s"),
        ("x = bytearray(1 << 30)", "error", "MemoryError (the limit is 256 MB)"),
        ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)", "error", None),
    ],
)
def test_tool_outcomes(program, status, output):
    # Only the sleeping program should meet the 2 s limit: the others get time to start Python on
    # a crowded machine.
    limits = LIMITS if status == "timeout" else UNHURRIED
    result = isolated_or_fail_closed(lambda: run_tool(program, limits=limits))
    assert result.status == status, result
    if output is not None:
        assert result.output == output
    assert result.failed == (status != "ok")


def test_failing_tools_return_error_observations_and_are_counted(embedded):
    """Through the rollout: one prompt's tool works, one raises, one runs out of time; each
    trajectory goes on with the error in its context."""
    tokenizer = build_byte_tokenizer()
    programs = ["print('fine')", "raise KeyError('lost')", "while True: pass"]
    batch = [
        Prompt([1, 2, 3], "", None, {"program": program}, f"test:{i}", i)
        for i, program in enumerate(programs)
    ]
    cfg = train_config(
        # Every byte ends a turn: each turn is one token, then the tool answers.
        env={"options": {"turns": 2, "tool_timeout_s": 3.0, "stop_token_ids": list(range(256))}},
        model={
            "vocab_size": 259,
            "hidden_size": 32,
            "num_layers": 1,
            "num_attention_heads": 2,
            "num_query_groups": 1,
            "head_dim": 8,
            "ffn_hidden_size": 32,
            "num_experts": 2,
            "moe_ffn_hidden_size": 16,
            "moe_router_topk": 1,
            "first_k_dense_layers": 0,
            "init_std": 0.2,
        },
        algo={
            "num_return_sequences_in_group": 1,
            "rollout_batch_size": 3,
            "routing_replay": "none",
            "response_length": 64,
        },
    )
    engine = EmbeddedEngine(cfg.model, seed=0)
    task = Task(tokenizer, None, [], tokenizer.eos_token_id)
    try:
        producer = environment_producer(engine, task, None, cfg, ToolScriptEnvironment)
        scored = isolated_or_fail_closed(lambda: producer.produce(batch, 0))
    finally:
        engine.close()
    observations = []
    for sample in scored.samples:
        response = sample.tokens[sample.prompt_length :]
        observed = response[~sample.loss_mask]
        observations.append(tokenizer.decode(observed.tolist()))
    assert observations == ["<fine>", "<error: KeyError: 'lost'>", "<error: timed out after 3 s>"]
    assert [s.finish_reason for s in scored.samples] == ["stop"] * 3  # the episodes went on
    metrics = scored.metrics
    # Two turns each, so two calls per trajectory (the second turn's output is not appended).
    assert metrics["env/tool_calls_mean"] == 2.0
    assert metrics["env/tool_failures"] == 4.0
    assert metrics["env/tool_timeouts"] == 2.0
    assert metrics["env/tool_success_frac"] == pytest.approx(2 / 6)


def test_python_tool_environment():
    tokenizer = build_byte_tokenizer()
    environment = PythonToolEnvironment(
        tokenizer=tokenizer, stop_tokens=["<|im_end|>"], tool_timeout_s=2.0
    )
    start = environment.reset(Prompt([5, 6], "", None, {}, "t", 0))
    assert list(start.stop_token_ids) == [258]

    def turn(text):
        return Turn(token_ids=tokenizer.encode(text, add_special_tokens=False), index=0)

    step = isolated_or_fail_closed(
        lambda: environment.step(turn("Let me check.<code>print(sum(range(5)))</code>"))
    )
    assert tokenizer.decode(step.observation_ids) == "\n<output>\n10\n</output>\n"
    assert (step.tool_calls, step.tool_failures, step.done) == (1, 0, False)
    failed = environment.step(turn("<code>1/0</code>"))
    assert "Error: ZeroDivisionError: division by zero" in tokenizer.decode(failed.observation_ids)
    assert failed.tool_failures == 1
    assert environment.step(turn("The answer is 10.")).done
    with pytest.raises(ConfigError, match="env.options.stop_tokens"):
        PythonToolEnvironment(tokenizer=tokenizer, stop_tokens=["<not a token>"])


def multiply_prompt(index: int = 0) -> Prompt:
    return synthetic_prompt("multiply", draw_digits(7, 0, index), f"multiply:train:{index}", index)


def test_multiply_environment_episode():
    prompt = multiply_prompt()
    a, b = prompt.prompt_text.removesuffix("<sep>").split("*")
    assert prompt.answer == str(int(a) * int(b))
    environment = MultiplyToolEnvironment(tool_timeout_s=5.0)
    start = environment.reset(prompt)
    assert list(start.stop_token_ids) == [CALL_END]
    call, answer = environment.demonstration()
    assert call == [CALL, *prompt.prompt_ids[:9], CALL_END]
    step = isolated_or_fail_closed(lambda: environment.step(Turn(call, 0)))
    assert list(step.observation_ids) == [RESULT, *map(int, prompt.answer), RESULT_END]
    assert (step.tool_calls, step.tool_failures, step.done, step.reward) == (1, 0, False, 0.0)
    bad = environment.step(Turn([CALL, 1, 2, TOOL_TOKENS["*"], CALL_END, CALL_END], 1))
    assert list(bad.observation_ids) == [RESULT, ERROR, RESULT_END] and bad.tool_failures == 1
    final = environment.step(Turn(answer, 2))
    assert final.done and final.reward == 1.0
    wrong_first_digit = [(answer[0] + 1) % 10, *answer[1:]]
    assert environment.step(Turn(wrong_first_digit, 2)).reward == pytest.approx(
        (len(prompt.answer) - 1 + 0.1) / len(prompt.answer)
    )


def test_the_demonstration_is_played_through_the_environment():
    tokenizer = build_synthetic_tokenizer(with_tool_tokens=True)
    cfg = train_config(
        env={"name": "multiply_tool"}, data={"task": "multiply"}, model={"vocab_size": 24}
    )
    prompt = multiply_prompt(3)
    task = Task(tokenizer, None, [], EOS_TOKEN_ID)
    sample = isolated_or_fail_closed(
        lambda: demonstration_sample(
            MultiplyToolEnvironment, prompt, task, EpisodeSettings.from_config(cfg)
        )
    )
    digits = list(map(int, prompt.answer))
    call = [CALL, *prompt.prompt_ids[:9], CALL_END]
    observation = [RESULT, *digits, RESULT_END]
    assert sample.tokens.tolist() == [
        *prompt.prompt_ids,
        *call,
        *observation,
        *digits,
        EOS_TOKEN_ID,
    ]
    assert sample.loss_mask.tolist() == [True] * 11 + [False] * len(observation) + [True] * (
        len(digits) + 1
    )
    assert float(sample.advantages) == 1.0


def test_environments_load_by_name_and_path():
    assert load_environment(EnvironmentSpec("single_turn")).__name__ == "SingleTurnEnvironment"
    factory = load_environment(
        EnvironmentSpec("tests.envs.scripted:ScriptedEnvironment", {"turns": 2})
    )
    assert factory.__name__ == "ScriptedEnvironment"
    for spec, fragment in (
        (EnvironmentSpec("no_such_env"), "unknown environment"),
        (EnvironmentSpec("no_such_module:Env"), "cannot import module"),
        (EnvironmentSpec("tests.envs.scripted:Missing"), "has no class or function"),
        (EnvironmentSpec("single_turn", {"colour": "red"}), "unknown option"),
    ):
        with pytest.raises(ConfigError, match=fragment):
            load_environment(spec)


def test_a_tool_environment_fails_closed_at_start_without_the_sandbox(monkeypatch):
    monkeypatch.setenv("MEGATRON_GSPO_BWRAP", "/nonexistent/bwrap")
    with pytest.raises(ConfigError, match="env.options.isolation"):
        load_environment(EnvironmentSpec("multiply_tool"))
    load_environment(EnvironmentSpec("multiply_tool", {"isolation": "none"}))  # the opt-out


def test_padded_turn_inputs_put_the_outcome_at_the_last_turn():
    multi = TrainSample(
        tokens=torch.arange(9),
        prompt_length=3,
        loss_mask=torch.tensor([True, True, False, True, False, True]),
        turns=torch.tensor([0, 0, -1, 1, -1, 2], dtype=torch.int16),
        turn_rewards=torch.tensor([0.5, 0.0, 0.25], dtype=torch.float64),
        reward=1.75,  # 0.75 from the turns, 1.0 from a reward function
    )
    single = TrainSample(tokens=torch.arange(5), prompt_length=3, reward=0.5)
    inputs = _padded_turns([multi, single])
    assert inputs["turn_rewards"].tolist() == [[0.5, 0.0, 1.25], [0.5, 0.0, 0.0]]
    assert inputs["turn_mask"].tolist() == [[True, True, True], [True, False, False]]
    assert inputs["token_turns"].tolist() == [[0, 0, -1, 1, -1, 2], [0, 0, -1, -1, -1, -1]]
    assert inputs["response_mask"][1].tolist() == [True, True, False, False, False, False]

"""Prompt streams: deterministic shuffling, resumable order, group ids, builders from the config."""

import json
from pathlib import Path

import pytest

from megatron_gspo.config import AlgoConfig, ConfigError, DataConfig, ModelConfig
from megatron_gspo.data import (
    FilePromptStream,
    SyntheticPromptStream,
    build_byte_tokenizer,
    build_eval_prompts,
    build_prompt_stream,
    build_tokenizer,
    load_prompt_dataset,
)

NUM_PROMPTS = 7


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "numbers.jsonl"
    lines = [json.dumps({"prompt": f"prompt {i}", "answer": str(i)}) for i in range(NUM_PROMPTS)]
    path.write_text("\n".join(lines) + "\n")
    return path


def answers(prompts) -> list[int]:
    return [int(prompt.answer) for prompt in prompts]


def make_stream(path, tokenizer, seed=3, shuffle=True) -> FilePromptStream:
    dataset = load_prompt_dataset(path, tokenizer, max_prompt_length=64)
    return FilePromptStream(dataset, seed=seed, shuffle=shuffle)


def test_epochs_are_seeded_permutations(prompt_file, tokenizer):
    stream = make_stream(prompt_file, tokenizer)
    epoch_0 = answers(stream.next_batch(NUM_PROMPTS))
    epoch_1 = answers(stream.next_batch(NUM_PROMPTS))
    assert sorted(epoch_0) == sorted(epoch_1) == list(range(NUM_PROMPTS))
    assert epoch_0 != epoch_1  # each epoch has its own order
    assert stream.epoch == 1
    same_seed = make_stream(prompt_file, tokenizer)
    assert answers(same_seed.next_batch(2 * NUM_PROMPTS)) == epoch_0 + epoch_1
    other_seed = make_stream(prompt_file, tokenizer, seed=4)
    assert answers(other_seed.next_batch(NUM_PROMPTS)) != epoch_0
    unshuffled = make_stream(prompt_file, tokenizer, shuffle=False)
    assert answers(unshuffled.next_batch(NUM_PROMPTS + 2)) == [*range(NUM_PROMPTS), 0, 1]


def test_group_ids_are_stream_positions(prompt_file, tokenizer):
    stream = make_stream(prompt_file, tokenizer)
    ids = [prompt.group_id for _ in range(4) for prompt in stream.next_batch(3)]
    assert ids == list(range(12))


@pytest.mark.parametrize("split", [2, 5, 7, 10])
def test_resume_gives_the_same_prompts_in_the_same_order(prompt_file, tokenizer, split):
    uninterrupted = make_stream(prompt_file, tokenizer)
    expected = uninterrupted.next_batch(3 * NUM_PROMPTS)
    first = make_stream(prompt_file, tokenizer)
    before = first.next_batch(split)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store plain data
    resumed = make_stream(prompt_file, tokenizer)
    resumed.load_state_dict(state)
    after = resumed.next_batch(3 * NUM_PROMPTS - split)
    assert [(p.answer, p.group_id) for p in before + after] == [
        (p.answer, p.group_id) for p in expected
    ]


def test_resume_with_other_data_or_seed_is_refused(prompt_file, tokenizer, tmp_path):
    state = make_stream(prompt_file, tokenizer).state_dict()
    with pytest.raises(ValueError, match="seed=3, this run has seed=9"):
        make_stream(prompt_file, tokenizer, seed=9).load_state_dict(state)
    smaller = tmp_path / "smaller.jsonl"
    smaller.write_text("\n".join(prompt_file.read_text().splitlines()[:3]) + "\n")
    with pytest.raises(ValueError, match="num_prompts=7, this run has num_prompts=3"):
        make_stream(smaller, tokenizer).load_state_dict(state)
    edited = tmp_path / "edited.jsonl"
    edited.write_text(prompt_file.read_text().replace("prompt 3", "prompt three"))
    with pytest.raises(ValueError, match="prompts_sha256"):
        make_stream(edited, tokenizer).load_state_dict(state)
    moved = tmp_path / "moved.jsonl"
    moved.write_text(prompt_file.read_text())
    make_stream(moved, tokenizer).load_state_dict(state)  # same prompts elsewhere: resumes


def test_synthetic_stream_resume_and_disjoint_eval():
    stream = SyntheticPromptStream("digit_reversal", seed=11, num_eval_prompts=50)
    expected = stream.next_batch(40)
    first = SyntheticPromptStream("digit_reversal", seed=11, num_eval_prompts=50)
    first.next_batch(17)
    resumed = SyntheticPromptStream("digit_reversal", seed=11, num_eval_prompts=50)
    resumed.load_state_dict(first.state_dict())
    assert resumed.next_batch(23) == expected[17:]
    assert [p.group_id for p in expected] == list(range(40))
    with pytest.raises(ValueError, match="task='digit_reversal', this run has task='digit_sort'"):
        SyntheticPromptStream("digit_sort", seed=11, num_eval_prompts=50).load_state_dict(
            first.state_dict()
        )


def test_synthetic_train_skips_eval_prompts(monkeypatch):
    from megatron_gspo.data import stream as stream_module

    # Make train prompt 1 collide with eval prompt 0 to see it skipped (and counted).
    original = stream_module.draw_digits

    def colliding(seed, stream, index):
        if stream == stream_module.TRAIN_STREAM and index == 1:
            return original(seed, stream_module.EVAL_STREAM, 0)
        return original(seed, stream, index)

    monkeypatch.setattr(stream_module, "draw_digits", colliding)
    stream = SyntheticPromptStream("digit_reversal", seed=5, num_eval_prompts=4)
    batch = stream.next_batch(3)
    assert [p.source for p in batch] == [f"digit_reversal:train:{i}" for i in (0, 2, 3)]
    assert stream.stats()["data_skipped_eval_overlap"] == 1
    # Served prompts again by stream id, across the skipped draw.
    assert stream.prompts_by_id([2, 0, 1]) == [batch[2], batch[0], batch[1]]


def test_prompts_by_id_serves_the_same_prompts_again(prompt_file, tokenizer):
    """Exactly-once resumes re-queue prompts by stream id: the same prompt, also from another
    epoch, from a stream restored from the state."""
    stream = make_stream(prompt_file, tokenizer)
    served = stream.next_batch(2 * NUM_PROMPTS + 3)
    ids = [16, 0, 9, 6, 7]
    assert stream.prompts_by_id(ids) == [served[i] for i in ids]
    restored = make_stream(prompt_file, tokenizer)
    restored.load_state_dict(stream.state_dict())
    assert restored.prompts_by_id(ids) == [served[i] for i in ids]
    synthetic = SyntheticPromptStream("digit_copy", seed=2, num_eval_prompts=4)
    drawn = synthetic.next_batch(6)
    assert synthetic.prompts_by_id([5, 1]) == [drawn[5], drawn[1]]
    for never_served in (17, -1):
        with pytest.raises(ValueError, match="never served"):
            stream.prompts_by_id([never_served])


def test_build_from_config_synthetic():
    data, algo = DataConfig(task="digit_sort", num_eval_prompts=16), AlgoConfig()
    tokenizer = build_tokenizer(data, ModelConfig())
    stream = build_prompt_stream(data, algo, tokenizer, seed=1)
    batch = stream.next_batch(algo.rollout_batch_size)
    assert len(batch) == algo.rollout_batch_size
    for prompt in batch:
        digits = prompt.prompt_ids[:-1]
        assert prompt.prompt_ids[-1] == tokenizer.sep_token_id
        assert prompt.answer == "".join(map(str, sorted(digits)))
        assert tokenizer.decode(prompt.prompt_ids) == prompt.prompt_text
    eval_prompts = build_eval_prompts(data, algo, tokenizer, seed=1)
    assert [p.group_id for p in eval_prompts] == list(range(16))
    assert eval_prompts == build_eval_prompts(data, algo, tokenizer, seed=1)
    train_digits = {tuple(p.prompt_ids) for p in stream.next_batch(2000)}
    assert not train_digits & {tuple(p.prompt_ids) for p in eval_prompts}


def test_build_from_config_file(prompt_file, tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    build_byte_tokenizer().save_pretrained(tokenizer_dir)
    data = DataConfig(
        train_path=str(prompt_file), eval_path=str(prompt_file), tokenizer_path=str(tokenizer_dir)
    )
    algo = AlgoConfig(prompt_length=64)
    tokenizer = build_tokenizer(data, ModelConfig(vocab_size=512))
    stream = build_prompt_stream(data, algo, tokenizer, seed=2)
    assert sorted(answers(stream.next_batch(NUM_PROMPTS))) == list(range(NUM_PROMPTS))
    eval_prompts = build_eval_prompts(data, algo, tokenizer, seed=2)
    assert answers(eval_prompts) == list(range(NUM_PROMPTS))
    assert build_eval_prompts(DataConfig(train_path=str(prompt_file)), algo, tokenizer, 2) == []


def test_builder_config_errors(prompt_file):
    with pytest.raises(ConfigError, match="set model.vocab_size >= 15"):
        build_tokenizer(DataConfig(), ModelConfig(vocab_size=8))
    with pytest.raises(ConfigError, match="cannot load a tokenizer from"):
        build_tokenizer(
            DataConfig(train_path=str(prompt_file), tokenizer_path=str(prompt_file.parent)),
            ModelConfig(),
        )
    with pytest.raises(ConfigError, match="data.tokenizer_path"):
        build_tokenizer(DataConfig(train_path=str(prompt_file)), ModelConfig())
    with pytest.raises(ConfigError, match="data.tokenizer_path"):
        build_tokenizer(DataConfig(tokenizer_path="/some/dir"), ModelConfig())
    with pytest.raises(ConfigError, match="data.task"):
        build_prompt_stream(DataConfig(task="digit_sum"), AlgoConfig(), None, seed=0)
    with pytest.raises(ConfigError, match="algo.prompt_length"):
        build_prompt_stream(DataConfig(), AlgoConfig(prompt_length=8), None, seed=0)

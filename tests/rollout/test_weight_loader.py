"""On-disk HF names -> transformers 5 packed experts: bit-exact, strict and atomic loading."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.weight_loader import HFWeightLayout, iter_safetensors_directory
from megatron_gspo.weight_sync import StableTensorStream
from tests.rollout.conftest import tiny_model_config

ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe", "qwen3", "glm4_moe", "deepseek_v3")


def _saved_state(engine: EmbeddedEngine, directory) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes: the on-disk names SGLang's loaders accept."""
    engine.hf_model.save_pretrained(str(directory))
    return load_file(str(directory / "model.safetensors"))


def _parameters(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.hf_model.named_parameters()}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_save_pretrained_state_loads_bit_for_bit(architecture, tmp_path):
    config = tiny_model_config(architecture)
    source = EmbeddedEngine(config, seed=11)
    target = EmbeddedEngine(config, seed=12)
    saved = _saved_state(source, tmp_path)
    # The names we expect are exactly the names save_pretrained writes.
    assert sorted(saved) == target._layout.disk_names
    stats = target.sync_weights(iter(saved.items()), version=4)
    assert stats.num_tensors == len(saved)
    assert stats.num_bytes == sum(t.numel() * t.element_size() for t in saved.values())
    assert target.weight_version == 4
    for name, param in source.hf_model.named_parameters():
        assert torch.equal(param, dict(target.hf_model.named_parameters())[name]), name
    # And the other way: our on-disk view of the model equals what save_pretrained wrote.
    for name, tensor in target.hf_state():
        assert torch.equal(tensor, saved[name]), name


def test_mixtral_names_are_block_sparse_moe_w1_w2_w3(tmp_path):
    engine = EmbeddedEngine(tiny_model_config("mixtral"), seed=0)
    names = engine._layout.disk_names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in names
    assert not any(".mlp." in name for name in names)


def test_tied_embeddings_have_no_lm_head(tmp_path):
    config = tiny_model_config(tie_word_embeddings=True)
    source, target = EmbeddedEngine(config, seed=1), EmbeddedEngine(config, seed=2)
    saved = _saved_state(source, tmp_path)
    assert "lm_head.weight" not in saved
    target.sync_weights(iter(saved.items()), version=1)
    assert torch.equal(target.hf_model.lm_head.weight, source.hf_model.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="ties its embeddings"):
        target.sync_weights(
            iter([*saved.items(), ("lm_head.weight", saved["model.embed_tokens.weight"])]), 2
        )


def _bad_sync(engine, stream, match):
    before = _parameters(engine)
    with pytest.raises(ValueError, match=match):
        engine.sync_weights(stream, version=9)
    assert engine.weight_version == 0
    for name, param in engine.hf_model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed by a failed sync"


def test_failed_syncs_name_the_tensor_and_leave_the_model_untouched(tmp_path):
    config = tiny_model_config()
    source, target = EmbeddedEngine(config, seed=1), EmbeddedEngine(config, seed=2)
    saved = list(_saved_state(source, tmp_path).items())
    expert = "model.layers.1.mlp.experts.2.up_proj.weight"
    _bad_sync(
        target,
        iter([*saved, ("model.layers.9.mlp.gate.weight", torch.zeros(4, 32))]),
        "unknown tensor 'model.layers.9",
    )
    _bad_sync(
        target,
        iter([(n, torch.zeros(3, 3) if n == expert else t) for n, t in saved]),
        f"{expert}' has shape \\(3, 3\\)",
    )
    _bad_sync(target, iter([(n, t) for n, t in saved if n != expert]), f"1 of .* missing: {expert}")
    _bad_sync(target, iter([*saved, saved[0]]), "arrived twice")
    _bad_sync(
        target,
        iter([*saved, ("model.layers.1.mlp.experts.gate_up_proj", torch.zeros(4, 48, 32))]),
        "per-expert on-disk names",
    )


def _raising_midway(pairs, after: int):
    """The producer fails (a collective, a socket, a disk) after ``after`` tensors."""
    for index, pair in enumerate(pairs):
        if index == after:
            raise ConnectionError("weight producer died")
        yield pair


def test_producer_failing_midway_leaves_the_model_untouched(tmp_path):
    config = tiny_model_config()
    source, target = EmbeddedEngine(config, seed=1), EmbeddedEngine(config, seed=2)
    saved = list(_saved_state(source, tmp_path).items())
    before = _parameters(target)
    with pytest.raises(ConnectionError, match="producer died"):
        target.sync_weights(_raising_midway(saved, len(saved) - 1), version=3)
    assert target.weight_version == 0
    for name, param in target.hf_model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed by a failed sync"


@pytest.mark.parametrize("borrow", [False, True], ids=["copy", "borrow"])
def test_layout_load_is_all_or_nothing_when_borrowing_too(borrow, tmp_path):
    config = tiny_model_config()
    source, target = EmbeddedEngine(config, seed=1), EmbeddedEngine(config, seed=2)
    layout = HFWeightLayout(target.hf_model)
    saved = list(_saved_state(source, tmp_path).items())
    expert = "model.layers.1.mlp.experts.2.up_proj.weight"
    before = _parameters(target)
    bad_streams = [
        (_raising_midway(saved, len(saved) // 2), ConnectionError),
        (iter([(n, t) for n, t in saved if n != expert]), ValueError),
        (iter([(n, torch.zeros(3, 3) if n == expert else t) for n, t in saved]), ValueError),
        (iter([*saved, saved[0]]), ValueError),
    ]
    for stream, error in bad_streams:
        with pytest.raises(error):
            layout.load(StableTensorStream(stream), borrow=borrow)
        for name, param in target.hf_model.named_parameters():
            assert torch.equal(param, before[name]), f"{name} changed by a failed load"
    assert layout.load(StableTensorStream(iter(saved)), borrow=borrow) == (
        len(saved),
        sum(t.numel() * t.element_size() for _, t in saved),
    )
    for name, param in source.hf_model.named_parameters():
        assert torch.equal(param, dict(target.hf_model.named_parameters())[name]), name


def test_borrowing_stages_references_and_copying_survives_a_reused_buffer(tmp_path):
    config = tiny_model_config()
    source, target = EmbeddedEngine(config, seed=1), EmbeddedEngine(config, seed=2)
    layout = HFWeightLayout(target.hf_model)
    saved = _saved_state(source, tmp_path)

    staged, num_tensors, _ = layout.stage(iter(saved.items()), borrow=True)
    assert num_tensors == len(saved) and not staged.buffers
    assert all(
        any(tensor.data_ptr() == t.data_ptr() for t in saved.values())
        for _, tensor in staged.borrowed
    )

    def reused_buffers():
        # A receiver that overwrites one buffer per shape for every tensor: fine to copy from,
        # wrong to borrow from.
        buffers: dict = {}
        for name, tensor in saved.items():
            buffer = buffers.setdefault((tensor.shape, tensor.dtype), torch.empty_like(tensor))
            yield name, buffer.copy_(tensor)

    staged, _, _ = layout.stage(reused_buffers(), borrow=False)
    assert not staged.borrowed
    layout.commit(staged)
    for name, param in source.hf_model.named_parameters():
        assert torch.equal(param, dict(target.hf_model.named_parameters())[name]), name


def _peak_rss_growth_bytes(function) -> int | None:
    """Peak RSS during ``function()`` above the RSS before it (Linux ``clear_refs``), or None."""

    def status_kb(field: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return None
    start = status_kb("VmRSS")
    function()
    return (status_kb("VmHWM") - start) * 1024


def test_borrowed_load_needs_no_staging_memory():
    # Vocab 100k at hidden 32: embedding + output layer are 25.6 MB of the model's ~26 MB.
    config = tiny_model_config(vocab_size=100_000)
    source, target = EmbeddedEngine(config, seed=1), EmbeddedEngine(config, seed=2)
    layout = HFWeightLayout(target.hf_model)
    model_bytes = sum(t.numel() * t.element_size() for _, t in source.hf_state())
    borrowed = _peak_rss_growth_bytes(
        lambda: layout.load(StableTensorStream(source.hf_state()), borrow=True)
    )
    if borrowed is None:
        pytest.skip("/proc/self/clear_refs is not writable here (peak RSS cannot be reset)")
    # Copying would stage the whole model first (one model's bytes; not asserted, since freed
    # heap pages that are still resident may serve it).
    assert borrowed < 0.2 * model_bytes, (borrowed, model_bytes)
    for name, tensor in target.hf_state():
        assert torch.equal(tensor, dict(source.hf_state())[name]), name


def test_bf16_tensors_are_cast_to_the_model_dtype(tmp_path):
    config = tiny_model_config()
    source, target = EmbeddedEngine(config, seed=1), EmbeddedEngine(config, seed=2)
    saved = _saved_state(source, tmp_path)
    target.sync_weights(((n, t.to(torch.bfloat16)) for n, t in saved.items()), version=1)
    for name, tensor in target.hf_state():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, saved[name].to(torch.bfloat16).float()), name


def test_directory_loader_reads_index_or_all_files(tmp_path):
    engine = EmbeddedEngine(tiny_model_config(), seed=1)
    engine.hf_model.save_pretrained(str(tmp_path / "single"))
    names = sorted(name for name, _ in iter_safetensors_directory(str(tmp_path / "single")))
    assert names == engine._layout.disk_names
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_safetensors_directory(str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        list(iter_safetensors_directory(str(tmp_path / "empty")))

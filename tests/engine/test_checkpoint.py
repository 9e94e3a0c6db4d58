"""Distributed checkpoints: exact resume, resharding, atomic directories, clear errors.

Four launches of ``checkpoint_worker.py`` (1, 4, 2, then 1 process), each loading what the
earlier ones saved. Model: tiny Qwen2-MoE (dense first layer, shared expert, tied embeddings),
AdamW with weight decay, warm-up and cosine decay; checkpoints after 2 optimizer steps, then 2
more steps. "Exact" means the same floats: loss, grad norm, lr and every weight.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from test_layouts import (
    BF16_EXACT_LAYOUTS,
    BF16_EXACT_METRIC_TOLERANCE,
    BF16_LOG_PROB_TOLERANCE,
    BF16_METRIC_TOLERANCE,
    BF16_WEIGHT_TOLERANCE,
)
from worker_launch import REPO_ROOT, run_worker, worker_command

WORKER = Path(__file__).with_name("checkpoint_worker.py")
CONVERT_CLI = REPO_ROOT / "tools" / "convert_checkpoint.py"

LOSS_TOLERANCE = 1e-6
"""Relative: the same weights at another layout give the same loss up to fp32 reduction order."""
WEIGHT_TOLERANCE = 1e-6
"""Absolute, after 2 AdamW steps (lr ~1e-3) continued at another layout. A lost Adam state moves
weights by ~1e-4 (checked by the weights-only control)."""


def _launch(out: Path, phase: str, world: int) -> dict:
    run_worker([*worker_command(WORKER, world), "--phase", phase, "--out", str(out)], 600)
    return json.loads((out / f"{phase}.json").read_text())


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def one(out) -> dict:
    return _launch(out, "one", 1)


@pytest.fixture(scope="module")
def four(out, one) -> dict:
    return _launch(out, "four", 4)


@pytest.fixture(scope="module")
def two(out, four) -> dict:
    return _launch(out, "two", 2)


@pytest.fixture(scope="module")
def last(out, two) -> dict:
    return _launch(out, "last", 1)


@pytest.fixture(scope="module")
def bf16_four(out) -> dict:
    return _launch(out, "bf16_four", 4)


@pytest.fixture(scope="module")
def bf16_two(out, bf16_four) -> dict:
    return _launch(out, "bf16_two", 2)


def _check_exact_resume(report: dict, tag: str) -> None:
    assert report[f"{tag}/loaded_weights_max_abs"] == 0.0
    assert report[f"{tag}/extra_state_equal"] is True
    assert report[f"{tag}/step_count"] == 2
    continued, resumed = report[f"{tag}/continued"], report[f"{tag}/resumed"]
    assert resumed == continued  # loss, grad norm and lr, float for float
    assert report[f"{tag}/resumed_weights_max_abs"] == 0.0
    # The schedule moved on (warm-up then cosine): a wrong restored step would change the lr.
    assert continued[0]["lr"] != continued[1]["lr"]


def _check_cross_load(report: dict, tag: str, source: dict, source_tag: str) -> None:
    """Loaded at another layout: bit-identical weights; the same next loss; the continued run
    follows the source run's trajectory (optimizer state and schedule carried over)."""
    assert report[f"{tag}/loaded_weights_max_abs"] == 0.0, tag
    assert report[f"{tag}/step_count"] == 2
    resumed, reference = report[f"{tag}/resumed"], source[f"{source_tag}/continued"]
    for got, want in zip(resumed, reference):
        assert math.isclose(got["loss"], want["loss"], rel_tol=LOSS_TOLERANCE), (tag, got, want)
        assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=1e-5), (tag, got, want)
        assert got["lr"] == want["lr"]
    assert report[f"{tag}/resumed_weights_max_abs"] < WEIGHT_TOLERANCE, tag


def test_exact_resume_one_process(one):
    _check_exact_resume(one, "one")


def test_lost_optimizer_state_is_detectable(one):
    """Control: weights without the optimizer state continue elsewhere, far beyond tolerance."""
    assert one["control/extra_state_returned"] is True
    assert one["control/weights_only_max_abs"] > 100 * WEIGHT_TOLERANCE


def test_weights_only_loads(one):
    """``load_weights_only`` (checkpoint.load_path) from a checkpoint root and from a plain
    torch_dist directory without checkpoint.json (the hf-to-megatron format)."""
    assert one["weights_only/max_abs"] == 0.0
    assert one["weights_only/optimizer_state_empty"] is True
    assert one["control/plain_torch_dist_max_abs"] == 0.0


def test_rng_states_restored(one):
    """python, numpy, torch and Megatron's tensor-parallel tracker draw the same numbers."""
    assert one["rng/restored"] is True


def test_optimizer_keys_match_megatron_non_distributed_format(one):
    assert one["format/same_keys_as_megatron"] is True


def test_directories_are_atomic_and_pruned(one):
    """A leftover .tmp dir and a step dir without checkpoint.json are never the latest, cannot
    be loaded, and are removed by the next save; keep_last prunes; ``latest`` is followed, and a
    stale ``latest`` falls back to the newest complete checkpoint; saving a step again replaces
    it."""
    for name in (
        "latest_ignores_incomplete",
        "incomplete_refused",
        "stale_removed",
        "pruned_to_keep_last",
        "latest_file",
        "latest",
        "latest_fallback",
        "latest_followed",
        "same_step_replaced",
    ):
        assert one[f"dirs/{name}"] is True, name


def test_clear_errors(one):
    for name in (
        "non_json_extra_state",
        "int_keys_extra_state",
        "nothing_written",
        "schedule_change",
        "model_change",
    ):
        assert one[f"errors/{name}"] is True, name


def test_allowed_schedule_change_continues_the_new_schedule(one):
    """lr 1e-3 -> 2e-3 (min 1e-4) at the saved step: the cosine factor is kept, the peak is new."""
    old_lr = one["one/continued"][0]["lr"]
    factor = (old_lr - 1e-4) / (1e-3 - 1e-4)
    assert math.isclose(one["schedule/new_lr_after_load"], 1e-4 + factor * (2e-3 - 1e-4))


@pytest.mark.distributed
def test_exact_resume_tp2_ep2_both_optimizers(four):
    _check_exact_resume(four, "four")
    _check_exact_resume(four, "four_distopt")


@pytest.mark.distributed
def test_one_process_checkpoint_loads_at_tp2_ep2(four, one):
    _check_cross_load(four, "one_to_four", one, "one")


@pytest.mark.distributed
def test_exact_resume_pp2_and_dp2_distributed_optimizer(two):
    """pp2: the first stage has no experts (one chained optimizer fewer than the last stage)
    and the last holds the tied output copy."""
    _check_exact_resume(two, "two")
    _check_exact_resume(two, "two_distopt")


@pytest.mark.distributed
def test_tp2_ep2_checkpoints_load_at_pp2_and_dp2(two, four):
    _check_cross_load(two, "four_to_pp2", four, "four")
    _check_cross_load(two, "four_distopt_to_dp2", four, "four_distopt")


@pytest.mark.distributed
def test_multi_process_checkpoints_load_at_one_process(last, four, two):
    """tp2.ep2 (both optimizers; the distributed optimizer's state goes to the non-distributed
    one) and pp2 checkpoints resume in one process."""
    _check_cross_load(last, "four_to_one", four, "four")
    _check_cross_load(last, "four_distopt_to_one", four, "four_distopt")
    _check_cross_load(last, "two_to_one", two, "two")


def _check_reshard(report: dict, tag: str, source: dict, source_tag: str) -> None:
    """A distributed-optimizer checkpoint loaded at another layout: the weights, the fp32 main
    parameters and both Adam moments, gathered to full tensors by global name, are the saved
    ones bit for bit (a reshuffle of the same floats); the continued run follows the source's."""
    assert report[f"{tag}/loaded_optimizer_max_abs"] == 0.0, tag
    _check_cross_load(report, tag, source, source_tag)


@pytest.mark.distributed
def test_ep2_distributed_optimizer_checkpoint_resumes_at_ep4(four):
    """Saved at ep2 on 4 processes (dense dp4, experts ep2 x expert-dp2, the distributed
    optimizer's spans over both), resumed at ep4 (one expert per rank, other dense spans)."""
    _check_exact_resume(four, "ep2_distopt")
    _check_reshard(four, "ep2_distopt_to_ep4", four, "ep2_distopt")


@pytest.mark.distributed
def test_ep2_distributed_optimizer_checkpoint_resumes_at_tp2_and_pp2(two, four):
    """Into the non-distributed optimizer, tensor-parallel (every matrix split) and pipelined
    (the first stage without experts, a tied output copy on the last)."""
    _check_reshard(two, "ep2_distopt_to_tp2", four, "ep2_distopt")
    _check_reshard(two, "ep2_distopt_to_pp2", four, "ep2_distopt")


@pytest.mark.distributed
def test_ep2_distributed_optimizer_checkpoint_resumes_in_one_process(last, four):
    _check_reshard(last, "ep2_distopt_to_one", four, "ep2_distopt")


def _check_bf16_reshard(report: dict, tag: str, source: dict, source_tag: str, exact: bool) -> None:
    """bf16 (``model.dtype=bfloat16``): the bf16 weights and the optimizer's fp32 main
    parameters and moments arrive bit for bit (a reshuffle). The continued run then follows the
    source's within test_layouts' bf16 bounds: ``exact`` (the bf16 products of both layouts are
    the same operands in the same shapes) float for float, the metrics up to the order of their
    fp32 all-reduces; otherwise within the bounds of a layout that moves a bf16 rounding."""
    assert report[f"{tag}/loaded_weights_max_abs"] == 0.0, tag
    assert report[f"{tag}/loaded_optimizer_max_abs"] == 0.0, tag
    assert report[f"{tag}/step_count"] == 2
    resumed, reference = report[f"{tag}/resumed"], source[f"{source_tag}/continued"]
    assert len(resumed) == len(reference) == 2
    metric_bound = BF16_EXACT_METRIC_TOLERANCE if exact else BF16_METRIC_TOLERANCE
    for got, want in zip(resumed, reference):
        for name in ("loss", "grad_norm"):
            assert math.isclose(got[name], want[name], rel_tol=metric_bound), (tag, got, want)
        assert got["lr"] == want["lr"]
    weight_bound = 0.0 if exact else BF16_WEIGHT_TOLERANCE
    assert report[f"{tag}/resumed_weights_max_abs"] <= weight_bound, tag


@pytest.mark.distributed
def test_bf16_distributed_optimizer_checkpoint_resumes_at_pp2_and_one_process(two, last):
    """bf16 at dp2 with the distributed optimizer (fp32 main parameters in
    ``optimizer.state.fp32_param``), resumed in one process and at pp2.

    One process continues bit for bit (dp2 with the distributed optimizer is one of
    ``BF16_EXACT_LAYOUTS``). pp2 is exact there for test_layouts' untied MoE model, not for this
    one (measured: grad norm 1e-4 relative, weights 2.4e-4 after the two steps, loss exact), so
    pp2 gets the bounds of a layout that moves a bf16 rounding. The likely place (not isolated
    by an experiment): this model ties its embeddings, and under pp the two uses of the tied
    matrix (the first stage's lookup, the last stage's output layer) have their bf16 gradients
    rounded separately and summed in fp32 across the stages, where one process lets autograd
    sum them in bf16 first."""
    assert "dp2.distopt" in BF16_EXACT_LAYOUTS
    _check_exact_resume(two, "bf16_dp2_distopt")
    _check_bf16_reshard(last, "bf16_dp2_distopt_to_one", two, "bf16_dp2_distopt", exact=True)
    _check_bf16_reshard(two, "bf16_dp2_distopt_to_pp2", two, "bf16_dp2_distopt", exact=False)


@pytest.mark.distributed
def test_bf16_checkpoint_exports_to_hf_and_loads_in_transformers(out, last, tmp_path):
    """``tools/convert_checkpoint.py megatron-to-hf`` on the bf16 run's checkpoint root (saved at
    dp2 with the distributed optimizer): bf16 safetensors (the checkpoint's dtype; ``--dtype`` not
    given) equal, bit for bit, to the weights the trainer streams under HF names (its own
    Megatron -> HF path) after loading that checkpoint; transformers loads every tensor of it in
    bf16, and its log-probs of the trainer's batch, from bf16 logits upcast to fp32 as the
    trainer does, agree with the trainer's within the bf16 layout bound of test_layouts (two
    implementations of one bf16 forward round in different places; measured worst 2.2e-3,
    0.57 u, on log-probs ~ -4.2)."""
    import torch
    import transformers
    from safetensors.torch import load_file

    assert last["bf16_view/saved"] is True
    view = torch.load(out / "bf16_trainer_view.pt", weights_only=False)
    hf_dir = tmp_path / "hf"
    # The command line's main in this process: a subprocess would import torch and
    # transformers again (most of this test's time on a busy 2-core machine).
    spec = importlib.util.spec_from_file_location("convert_checkpoint", CONVERT_CLI)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    checkpoint_root = str(out / "ck_bf16_dp2_distopt")
    assert cli.main(["megatron-to-hf", "--ckpt", checkpoint_root, "--out", str(hf_dir)]) == 0

    exported: dict = {}
    for file in hf_dir.glob("*.safetensors"):
        exported.update(load_file(file))
    trainer = view["hf_weights"]
    assert sorted(exported) == sorted(trainer)
    for name, tensor in trainer.items():
        assert tensor.dtype == exported[name].dtype == torch.bfloat16, name
        assert torch.equal(exported[name], tensor), name
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["dtype"] == "bfloat16"

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, output_loading_info=True
    )
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    assert model.dtype == torch.bfloat16
    model.eval()
    worst = 0.0
    for tokens, prompt, expected in zip(view["tokens"], view["prompt_lengths"], view["log_probs"]):
        with torch.no_grad():
            logits = model(input_ids=tokens[None]).logits[0].float() / view["temperature"]
        log_probs = torch.log_softmax(logits[prompt - 1 : -1], dim=-1)
        got = log_probs.gather(1, tokens[prompt:, None]).squeeze(1)
        assert got.shape == expected.shape
        worst = max(worst, (got - expected).abs().max().item())
    assert worst < BF16_LOG_PROB_TOLERANCE, worst


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_ep2_distributed_optimizer_checkpoint_resumes_at_ep4_and_tp2(bf16_four, bf16_two):
    """bf16 saved at ep2 on 4 processes (distributed optimizer: fp32 main parameters in spans
    over dense dp4 and expert-dp2), resumed at ep4 and at tp2: the state arrives bit for bit;
    ep and tp move bf16 roundings, so the continued run gets the inexact bf16 bounds. Slow: two
    launches (4 and 2 processes) whose code paths the default tier covers in fp32 (the same
    reshard) and in bf16 (dp2 -> pp2, one process)."""
    _check_exact_resume(bf16_four, "bf16_ep2_distopt")
    _check_bf16_reshard(
        bf16_four, "bf16_ep2_distopt_to_ep4", bf16_four, "bf16_ep2_distopt", exact=False
    )
    _check_bf16_reshard(
        bf16_two, "bf16_ep2_distopt_to_tp2", bf16_four, "bf16_ep2_distopt", exact=False
    )

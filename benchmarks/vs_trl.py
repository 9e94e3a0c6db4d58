"""Our trainer against TRL's ``GRPOTrainer`` in GSPO mode, on the same job, one process each.

The job (identical on both sides; every TRL default that would change it is set explicitly, see
``trl_config`` and benchmarks/README.md, "vs TRL"):

* model: a random-init Qwen3-MoE (hidden 64, 2 MoE layers, 4 query / 2 KV heads of 16, 8 experts
  top-2 renormalised, expert intermediate 48, untied embeddings, vocab 64 or ``--vocab``, fp32,
  no router aux loss), built ONCE from ``--seed`` and saved with ``save_pretrained``; our trainer
  starts from it with ``model.hf_path``, TRL loads the same directory;
* task: digit reversal, 8 random digits and ``<sep>`` as the prompt; reward = mean over the 8
  answer positions of 1 (right digit), 0.1 (wrong digit), 0 (no digit)
  (``megatron_gspo.data.synthetic.score_digit_response``); the same prompts in the same order;
* per rollout step: 8 prompts x 8 samples x exactly 16 generated tokens (EOS cannot be sampled:
  ours ``rollout.min_new_tokens=16``, TRL ``generation_kwargs={"min_new_tokens": 16}``), then 4
  mini-batches of 16 samples, one AdamW step each (lr 1e-3 constant, no warm-up, grad clip 1.0);
* loss: GSPO (sequence ratio, clip 3e-4 / 4e-4, per-sequence token mean then sequence mean,
  beta = 0, group advantages (r - mean) / (std + 1e-4)), temperature 1, no top-p / top-k.

Old log-probs: ours take them from the rollout engine (``old_log_prob_source=rollout``, no
old-log-prob forward); TRL recomputes them with a forward of the policy over the 64 samples
(it must, since ``steps_per_generation > gradient_accumulation_steps``).

The frameworks alternate A B A B ... (``--repeats`` each), every run in a fresh subprocess with
the same thread count (``--threads``, default 1: on a shared, oversubscribed CPU box the OpenMP
barriers of 2 threads cost far more than they gain). Reported per framework (medians over runs
and over rollout steps after the first, which carries one-time costs):

* time per rollout step, start of one generation to the start of the next (the last step: to
  the end of its last optimizer step), and its split: rollout (generation), old log-probs,
  reward, forward+backward, optimizer (grad clip + step), weight sync and the rest (framework
  overhead: data, advantages, packing, logging, ...);
* generated tokens per second (8 x 8 x 16 = 1,024 per step over the step time);
* peak RSS (``VmHWM``) absolute, and above the RSS right after the libraries were imported
  (before any model, data or trainer is built; the peak counter is reset there);
* mean reward of the first and of the last rollout step;
* the ratios ours / TRL.

Usage (from the repository root)::

    python benchmarks/vs_trl.py                      # 8 rollout steps, 2 runs each, vocab 64
    python benchmarks/vs_trl.py --quick              # 3 steps, 2 runs each: a few minutes
    python benchmarks/vs_trl.py --vocab 151936       # the memory comparison at Qwen3's vocab
    python benchmarks/vs_trl.py --json               # one JSON object on stdout
    python benchmarks/vs_trl.py --checkout before=/path/to/old/checkout   # before/after
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

FRAMEWORKS = ("ours", "trl")
PHASES = (
    "rollout",
    "old_log_probs",
    "reward",
    "forward_backward",
    "optimizer",
    "weight_sync",
    "other",
)
TASK = "digit_reversal"
PROMPTS_PER_STEP = 8
GROUP_SIZE = 8
RESPONSE_TOKENS = 16
MINI_BATCHES = 4
CLIP_LOW, CLIP_HIGH = 3e-4, 4e-4
LEARNING_RATE = 1e-3
GRAD_CLIP = 1.0
STD_EPS = 1e-4
"""TRL's hard-wired epsilon of (r - mean) / (std + eps); ours is set to match."""


# ----------------------------------------------------------------------------------------------
# The job: model, tokenizer and prompts on disk, shared by every run
# ----------------------------------------------------------------------------------------------


def model_config(vocab_size: int):
    """The benchmark model as our :class:`~megatron_gspo.config.ModelConfig`."""
    from megatron_gspo.config import ModelConfig

    # Every field that shapes the network is spelled out: schema defaults change with the demo.
    return ModelConfig(
        architecture="qwen3_moe",
        vocab_size=vocab_size,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        ffn_hidden_size=128,
        num_experts=8,
        moe_ffn_hidden_size=48,
        moe_router_topk=2,
        moe_renormalize_topk=True,
        shared_expert_intermediate_size=0,
        first_k_dense_layers=0,
        qk_layernorm=True,
        add_qkv_bias=False,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        moe_aux_loss_coef=0.0,
        dtype="float32",
    )


def write_job(job_dir: Path, *, vocab_size: int, seed: int, steps: int) -> dict[str, Any]:
    """Save the seeded HF model, the synthetic tokenizer and the prompts of ``steps`` rollout
    steps (our prompt stream's, in its order) under ``job_dir``; returns the job description."""
    import torch
    import transformers

    from megatron_gspo.config import AlgoConfig, DataConfig
    from megatron_gspo.convert.hf_config import hf_config_from_model_config
    from megatron_gspo.data import build_prompt_stream, build_synthetic_tokenizer

    hf_config = hf_config_from_model_config(model_config(vocab_size))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, hf_config.architectures[0])(hf_config)
    model.save_pretrained(job_dir)
    tokenizer = build_synthetic_tokenizer()
    tokenizer.save_pretrained(job_dir)
    stream = build_prompt_stream(
        DataConfig(task=TASK),
        AlgoConfig(rollout_batch_size=PROMPTS_PER_STEP, response_length=RESPONSE_TOKENS),
        tokenizer,
        seed=seed,
    )
    prompts = stream.next_batch(PROMPTS_PER_STEP * steps)
    rows = [
        {"prompt": p.prompt_text, "prompt_ids": list(p.prompt_ids), "answer": p.answer}
        for p in prompts
    ]
    (job_dir / "prompts.json").write_text(json.dumps(rows))
    job = {
        "dir": str(job_dir),
        "vocab_size": vocab_size,
        "seed": seed,
        "steps": steps,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    (job_dir / "job.json").write_text(json.dumps(job))
    return job


def our_overrides(job: dict[str, Any], output_dir: str) -> list[str]:
    """Hydra overrides of our trainer for the job. Everything the job depends on is set here,
    not left to the schema defaults (those are the CPU demo's and change with it)."""
    return [
        f"model.hf_path={job['dir']}",
        f"model.vocab_size={job['vocab_size']}",
        f"steps={job['steps']}",
        f"seed={job['seed']}",
        f"output_dir={output_dir}",
        "sft_warmup_steps=0",  # RL from the saved weights, as TRL starts
        f"data.task={TASK}",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.ep=1",
        "parallel.cp=1",
        "parallel.micro_batch_tokens=4096",  # one micro-batch per mini-batch (16 x 25 tokens)
        f"algo.rollout_batch_size={PROMPTS_PER_STEP}",
        f"algo.num_return_sequences_in_group={GROUP_SIZE}",
        f"algo.response_length={RESPONSE_TOKENS}",
        f"algo.num_mini_batches={MINI_BATCHES}",
        "algo.ppo_epochs=1",
        "algo.importance_sampling=seq",
        f"algo.clip_low={CLIP_LOW}",
        f"algo.clip_high={CLIP_HIGH}",
        "algo.loss_agg_mode=seq-mean-token-mean",
        "algo.adv_estimator=grpo",
        "algo.std_unbiased=true",
        f"algo.std_eps={STD_EPS}",
        "algo.reward_norm=null",
        "algo.whiten_advantages=false",
        "algo.advantage_clip=null",
        "algo.reward_clip=null",
        "algo.dual_clip_loss=false",
        "algo.use_kl_loss=false",
        "algo.add_token_level_kl=false",
        "algo.entropy_coef=0.0",
        "algo.routing_replay=none",
        "algo.old_log_prob_source=rollout",
        # A metric (top-k overlap with the old routes) TRL does not compute.
        "algo.log_routing_change=false",
        f"optim.lr={LEARNING_RATE}",
        "optim.lr_decay_style=constant",
        "optim.lr_warmup_steps=0",
        "optim.weight_decay=0.0",
        f"optim.clip_grad={GRAD_CLIP}",
        "optim.min_lr=0.0",
        "optim.adam_beta1=0.9",
        "optim.adam_beta2=0.999",
        "optim.adam_eps=1e-8",
        "rollout.engine=embedded",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.top_k=-1",
        f"rollout.min_new_tokens={RESPONSE_TOKENS}",
        # In-process rewards, as TRL computes them (worker processes would hide their memory).
        "reward.executor=thread",
        "reward.functions=[synthetic]",
        "reward.weights=[]",
        "eval.interval=0",
        "checkpoint.interval=0",
        "logging.tensorboard=false",
        "logging.wandb=false",
        "logging.progress_bar=false",
        "logging.log_level=WARNING",
    ]


def trl_config(job: dict[str, Any], output_dir: str) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments. Each line overrides a TRL default that would make the
    job differ (its default in the comment), or pins one that matters (same value)."""
    return dict(
        output_dir=output_dir,
        use_cpu=True,
        seed=job["seed"],
        data_seed=job["seed"],
        max_steps=job["steps"] * MINI_BATCHES,  # counts optimizer steps
        # Precision and memory savers.
        bf16=False,  # default True
        fp16=False,
        gradient_checkpointing=False,  # default True
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
        cast_lm_head_to_fp32=False,
        # Batch geometry: 4 mini-batches of 16 per generation of 8 prompts x 8.
        per_device_train_batch_size=MINI_BATCHES * 4,  # default 8
        gradient_accumulation_steps=1,
        steps_per_generation=MINI_BATCHES,  # default 1
        num_generations=GROUP_SIZE,
        num_iterations=1,
        shuffle_dataset=False,  # default True: same prompt order as ours
        # GSPO loss.
        loss_type="grpo",  # default "dapo"
        importance_sampling_level="sequence",  # default "token"
        epsilon=CLIP_LOW,  # default 0.2
        epsilon_high=CLIP_HIGH,  # default None (= epsilon)
        delta=None,
        beta=0.0,
        scale_rewards="group",
        mask_truncated_completions=False,
        top_entropy_quantile=1.0,
        entropy_coef=0.0,
        use_adaptive_entropy=False,
        off_policy_mask_threshold=None,
        router_aux_loss_coef=0.0,  # default: the model's own coefficient (0.001 for Qwen3-MoE)
        disable_dropout=True,  # default False (the model has no dropout anyway)
        # Optimizer and schedule.
        learning_rate=LEARNING_RATE,  # default 1e-6
        lr_scheduler_type="constant",  # default "linear" decay
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=GRAD_CLIP,
        optim="adamw_torch_fused",
        # Generation: plain transformers generate, exactly RESPONSE_TOKENS tokens.
        use_vllm=False,
        use_transformers_paged=False,
        use_transformers_continuous_batching=False,
        max_completion_length=RESPONSE_TOKENS,  # default 512
        generation_kwargs={"min_new_tokens": RESPONSE_TOKENS},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        # No logging, evaluation or checkpoints inside the timed loop.
        report_to=[],
        logging_strategy="no",
        eval_strategy="no",
        save_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        torch_compile=False,
        use_liger_kernel=False,
    )


# ----------------------------------------------------------------------------------------------
# Measuring inside a worker
# ----------------------------------------------------------------------------------------------


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (Linux only)")


def _reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


class Timeline:
    """Step marks and timed phases of one run: wall time (``time.perf_counter``) and, for the
    whole step, CPU time of the process (``time.process_time``, all threads)."""

    def __init__(self) -> None:
        self.step_starts: list[float] = []
        self.step_ends: list[float] = []
        self.cpu_starts: list[float] = []
        self.cpu_ends: list[float] = []
        self.events: list[tuple[str, float, float]] = []
        self.cpu_events: list[tuple[str, float, float]] = []

    def mark_start(self) -> None:
        self.step_starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def mark_end(self) -> None:
        self.step_ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())

    @contextlib.contextmanager
    def phase(self, name: str):
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.events.append((name, start, time.perf_counter() - start))
            self.cpu_events.append((name, start, time.process_time() - cpu_start))

    def wrap(self, name: str, function: Callable) -> Callable:
        """``function`` timed as phase ``name``."""

        def timed(*args, **kwargs):
            with self.phase(name):
                return function(*args, **kwargs)

        return timed

    def steps(self) -> list[dict[str, float]]:
        """Per rollout step: ``step`` (start to next start; the last: to its end) and phases."""
        starts = self.step_starts
        result = []
        for index, start in enumerate(starts):
            last = index + 1 == len(starts)
            end = self.step_ends[-1] if last else starts[index + 1]
            cpu_end = self.cpu_ends[-1] if last else self.cpu_starts[index + 1]
            phases = defaultdict(float)
            for name, event_start, seconds in self.events:
                if start <= event_start < end:
                    phases[name] += seconds
            step = {"step": end - start, "cpu": cpu_end - self.cpu_starts[index]}
            step.update({name: phases.get(name, 0.0) for name in PHASES if name != "other"})
            step["other"] = step["step"] - sum(step[name] for name in PHASES if name != "other")
            cpu = defaultdict(float)
            for name, event_start, seconds in self.cpu_events:
                if start <= event_start < end:
                    cpu[name] += seconds
            step["cpu_phases"] = dict(cpu)
            result.append(step)
        return result


def _finish(
    timeline: Timeline, rewards: list[float], baseline_kb: int, import_peak_kb: int, reset: bool
) -> dict[str, Any]:
    peak_kb = _proc_status_kb("VmHWM")
    return {
        "steps": timeline.steps(),
        "rewards": rewards,
        "rss_post_import_mb": baseline_kb / 1024,
        "peak_rss_mb": max(peak_kb, import_peak_kb) / 1024,
        "peak_above_import_mb": (peak_kb - baseline_kb) / 1024 if reset else None,
        "peak_reset_ok": reset,
    }


def run_ours(job: dict[str, Any], work_dir: str) -> dict[str, Any]:
    # Everything the loop imports lazily, imported before the baseline is taken.
    import hydra  # noqa: F401
    import megatron.core  # noqa: F401
    import omegaconf  # noqa: F401
    import torch  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401

    import megatron_gspo.convert.hf_config  # noqa: F401
    import megatron_gspo.data  # noqa: F401
    import megatron_gspo.engine.hf_import_export  # noqa: F401
    import megatron_gspo.reward  # noqa: F401
    import megatron_gspo.rollout.embedded  # noqa: F401
    import megatron_gspo.rollout.factory  # noqa: F401
    from megatron_gspo import loop
    from megatron_gspo.config_loader import load_config
    from megatron_gspo.engine.train_step import TrainEngine

    import_peak_kb = _proc_status_kb("VmHWM")
    baseline_kb = _proc_status_kb("VmRSS")
    reset = _reset_peak_rss()

    timeline = Timeline()
    generate, sync_weights = loop.generate, loop.sync_weights

    def timed_generate(*args, **kwargs):
        timeline.mark_start()
        with timeline.phase("rollout"):
            return generate(*args, **kwargs)

    def timed_sync(*args, **kwargs):
        with timeline.phase("weight_sync"):
            result = sync_weights(*args, **kwargs)
        timeline.mark_end()
        return result

    loop.generate, loop.sync_weights = timed_generate, timed_sync
    loop.score = timeline.wrap("reward", loop.score)
    loop.set_old_log_probs = timeline.wrap("old_log_probs", loop.set_old_log_probs)
    TrainEngine.forward_backward = timeline.wrap("forward_backward", TrainEngine.forward_backward)
    TrainEngine.optimizer_step = timeline.wrap("optimizer", TrainEngine.optimizer_step)

    records = loop.run(load_config(None, our_overrides(job, work_dir)))
    rewards = [record["reward_mean"] for record in records]
    return _finish(timeline, rewards, baseline_kb, import_peak_kb, reset)


def run_trl(job: dict[str, Any], work_dir: str) -> dict[str, Any]:
    import datasets
    import torch
    import transformers
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
    import trl

    from megatron_gspo.data.synthetic import score_digit_response

    import_peak_kb = _proc_status_kb("VmHWM")
    baseline_kb = _proc_status_kb("VmRSS")
    reset = _reset_peak_rss()

    timeline = Timeline()
    rewards: list[float] = []
    rows = json.loads((Path(job["dir"]) / "prompts.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(job["dir"])
    for row in rows[:4]:
        ids = tokenizer(text=row["prompt"])["input_ids"]
        if ids != row["prompt_ids"]:
            raise RuntimeError(f"TRL would see prompt ids {ids}, ours {row['prompt_ids']}")

    def digit_reward(completions, completion_ids, answer, **kwargs):
        scores = [score_digit_response(ids, target) for ids, target in zip(completion_ids, answer)]
        rewards.append(sum(scores) / len(scores))
        return scores

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            timeline.mark_start()
            return super()._generate_and_score_completions(inputs)

        def _generate_single_turn(self, *args, **kwargs):
            with timeline.phase("rollout"):
                return super()._generate_single_turn(*args, **kwargs)

        def _calculate_rewards(self, *args, **kwargs):
            with timeline.phase("reward"):
                return super()._calculate_rewards(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            # Without grad: the old-log-prob forward; with grad: part of compute_loss.
            if torch.is_grad_enabled():
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            with timeline.phase("old_log_probs"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def compute_loss(self, *args, **kwargs):
            with timeline.phase("forward_backward"):
                return super().compute_loss(*args, **kwargs)

        def _clip_grad_norm(self, *args, **kwargs):
            with timeline.phase("optimizer"):
                return super()._clip_grad_norm(*args, **kwargs)

    class StepMarks(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            timeline.events.append(("optimizer", self.start, time.perf_counter() - self.start))

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % MINI_BATCHES == 0:
                timeline.mark_end()

    dataset = datasets.Dataset.from_list(
        [{"prompt": row["prompt"], "answer": row["answer"]} for row in rows]
    )
    trainer = TimedGRPOTrainer(
        model=job["dir"],
        reward_funcs=digit_reward,
        args=trl.GRPOConfig(**trl_config(job, work_dir)),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepMarks()],
    )
    trainer.accelerator.backward = timeline.wrap("forward_backward", trainer.accelerator.backward)
    trainer.train()
    return _finish(timeline, rewards, baseline_kb, import_peak_kb, reset)


# ----------------------------------------------------------------------------------------------
# The driver: alternate fresh subprocesses, then summarise
# ----------------------------------------------------------------------------------------------


def run_worker(
    framework: str,
    job: dict[str, Any],
    threads: int,
    timeout_s: float,
    repo_root: Optional[str] = None,
) -> dict:
    """One run in a fresh interpreter, importing ``megatron_gspo`` from ``repo_root`` (this
    checkout by default); returns its measurements (raises with its log on error)."""
    with tempfile.TemporaryDirectory(prefix=f"vs_trl_{framework}_") as work_dir:
        result_path = Path(work_dir) / "result.json"
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS=str(threads),
            MKL_NUM_THREADS=str(threads),
            TOKENIZERS_PARALLELISM="false",
            CUDA_VISIBLE_DEVICES="",
            PYTHONWARNINGS="ignore",
        )
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            framework,
            "--job",
            job["dir"],
            "--result",
            str(result_path),
            "--threads",
            str(threads),
            "--repo-root",
            str(repo_root or REPO_ROOT),
        ]
        started = time.perf_counter()
        process = subprocess.run(
            command,
            cwd=work_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if process.returncode != 0 or not result_path.exists():
            raise RuntimeError(
                f"{framework} run failed (exit {process.returncode}):\n{process.stderr[-6000:]}"
            )
        result = json.loads(result_path.read_text())
        result["wall_s"] = time.perf_counter() - started
        return result


def _median(values: list[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Medians per framework over runs x steps (the first step of each run left out) and the
    ratios ours / TRL."""
    summary: dict[str, Any] = {}
    for framework, results in runs.items():
        steps = [step for result in results for step in result["steps"][1:]]
        if not steps:  # a one-step run: keep its only step
            steps = [step for result in results for step in result["steps"]]
        median_step = _median([s["step"] for s in steps])
        summary[framework] = {
            "runs": len(results),
            "steps_measured": len(steps),
            "step_s": median_step,
            "step_s_min": min(s["step"] for s in steps),
            "step_s_max": max(s["step"] for s in steps),
            "cpu_s": _median([s["cpu"] for s in steps]),
            "phases_s": {name: _median([s[name] for s in steps]) for name in PHASES},
            "generated_tokens_per_s": PROMPTS_PER_STEP * GROUP_SIZE * RESPONSE_TOKENS / median_step,
            "peak_rss_mb": _median([r["peak_rss_mb"] for r in results]),
            "rss_post_import_mb": _median([r["rss_post_import_mb"] for r in results]),
            "peak_above_import_mb": _median([r["peak_above_import_mb"] for r in results]),
            "reward_first": _median([r["rewards"][0] for r in results]),
            "reward_last": _median([r["rewards"][-1] for r in results]),
            "run_wall_s": [round(r["wall_s"], 1) for r in results],
        }
    if set(FRAMEWORKS) <= set(summary):
        ours, theirs = summary["ours"], summary["trl"]

        def ratio(a, b):
            return a / b if a is not None and b else None

        summary["ratio_ours_over_trl"] = {
            "step_s": ratio(ours["step_s"], theirs["step_s"]),
            "cpu_s": ratio(ours["cpu_s"], theirs["cpu_s"]),
            "peak_rss_mb": ratio(ours["peak_rss_mb"], theirs["peak_rss_mb"]),
            "peak_above_import_mb": ratio(
                ours["peak_above_import_mb"], theirs["peak_above_import_mb"]
            ),
            **{
                f"{name}_s": ratio(ours["phases_s"][name], theirs["phases_s"][name])
                for name in PHASES
            },
        }
    return summary


def format_table(summary: dict[str, Any], job: dict[str, Any], threads: int) -> str:
    frameworks = [f for f in summary if f != "ratio_ours_over_trl"]
    ratios = summary.get("ratio_ours_over_trl", {})

    def cell(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    header = ["metric", *frameworks] + (["ours/TRL"] if ratios else [])
    rows = [
        ["time per rollout step (s)"]
        + [cell(summary[f]["step_s"]) for f in frameworks]
        + ([cell(ratios.get("step_s"), 2)] if ratios else []),
    ]
    for name in PHASES:
        rows.append(
            [f"  {name} (s)"]
            + [cell(summary[f]["phases_s"][name]) for f in frameworks]
            + ([cell(ratios.get(f"{name}_s"), 2)] if ratios else [])
        )
    rows += [
        ["CPU time per rollout step (s)"]
        + [cell(summary[f]["cpu_s"]) for f in frameworks]
        + ([cell(ratios.get("cpu_s"), 2)] if ratios else []),
        ["generated tokens / s"]
        + [cell(summary[f]["generated_tokens_per_s"], 0) for f in frameworks]
        + ([cell(1 / ratios["step_s"], 2)] if ratios.get("step_s") else ([""] if ratios else [])),
        ["peak RSS (MB)"]
        + [cell(summary[f]["peak_rss_mb"], 0) for f in frameworks]
        + ([cell(ratios.get("peak_rss_mb"), 2)] if ratios else []),
        ["RSS after imports (MB)"]
        + [cell(summary[f]["rss_post_import_mb"], 0) for f in frameworks]
        + ([""] if ratios else []),
        ["peak above imports (MB)"]
        + [cell(summary[f]["peak_above_import_mb"], 0) for f in frameworks]
        + ([cell(ratios.get("peak_above_import_mb"), 2)] if ratios else []),
        ["reward first step"]
        + [cell(summary[f]["reward_first"]) for f in frameworks]
        + ([""] if ratios else []),
        ["reward last step"]
        + [cell(summary[f]["reward_last"]) for f in frameworks]
        + ([""] if ratios else []),
    ]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        f"vocab {job['vocab_size']}, {job['steps']} rollout steps per run, "
        f"{summary[frameworks[0]]['runs']} runs each (alternating), {threads} thread(s); "
        f"medians over runs x steps 2..{job['steps']}",
        "  ".join(h.ljust(w) for h, w in zip(header, widths)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=8, help="rollout steps per run (default 8; --quick: 3)"
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per framework, alternating (default 2)"
    )
    parser.add_argument(
        "--vocab", type=int, default=64, help="vocabulary size of the model (default 64)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="model, prompts and run seed")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch / OpenMP threads per run (default 1)"
    )
    parser.add_argument(
        "--frameworks",
        default="ours,trl",
        help="comma-separated subset of ours,trl (default both)",
    )
    parser.add_argument("--quick", action="store_true", help="3 rollout steps per run")
    parser.add_argument("--json", action="store_true", help="print one JSON object, no table")
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds per run before it is killed"
    )
    parser.add_argument(
        "--keep-job", metavar="DIR", default=None, help="write the job to DIR and keep it"
    )
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="also run our trainer from the checkout in DIR, as column LABEL, interleaved with "
        "the others (repeatable): before/after tables on the same machine state",
    )
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--repo-root", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    checkouts = []
    for item in args.checkout:
        label, _, directory = item.partition("=")
        if not label or not directory or label in FRAMEWORKS:
            parser.error(f"--checkout {item!r}: expected LABEL=DIR with LABEL not in {FRAMEWORKS}")
        if not (Path(directory) / "megatron_gspo").is_dir():
            parser.error(f"--checkout {item!r}: {directory} has no megatron_gspo package")
        checkouts.append((label, str(Path(directory).resolve())))
    args.checkout = checkouts
    if args.quick:
        args.steps = 3
    for name in ("steps", "repeats", "vocab", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.vocab < 15:
        parser.error("--vocab must be >= 15 (the synthetic tokenizer has 15 tokens)")
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = set(args.frameworks) - set(FRAMEWORKS)
    if unknown:
        parser.error(f"unknown frameworks {sorted(unknown)}; choose from {FRAMEWORKS}")
    return args


def worker_main(args: argparse.Namespace) -> int:
    if args.repo_root:
        # Nothing of megatron_gspo is imported yet: this decides which checkout is measured.
        sys.path.insert(0, args.repo_root)
    import torch

    torch.set_num_threads(args.threads)
    job = json.loads((Path(args.job) / "job.json").read_text())
    run = run_ours if args.worker == "ours" else run_trl
    result = run(job, os.getcwd())
    Path(args.result).write_text(json.dumps(result))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    job_dir = Path(args.keep_job or tempfile.mkdtemp(prefix="vs_trl_job_"))
    job_dir.mkdir(parents=True, exist_ok=True)
    try:
        job = write_job(job_dir, vocab_size=args.vocab, seed=args.seed, steps=args.steps)
        variants = [(label, "ours", root) for label, root in args.checkout]
        variants += [(f, f, None) for f in args.frameworks]
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
        for repeat in range(args.repeats):
            for name, framework, root in variants:
                if not args.json:
                    print(f"run {repeat + 1}/{args.repeats}: {name} ...", flush=True)
                runs[name].append(run_worker(framework, job, args.threads, args.timeout, root))
        summary = summarize(runs)
        if args.json:
            print(
                json.dumps(
                    {"job": job, "threads": args.threads, "summary": summary, "runs": runs},
                    indent=1,
                )
            )
        else:
            print(format_table(summary, job, args.threads))
    finally:
        if args.keep_job is None:
            shutil.rmtree(job_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

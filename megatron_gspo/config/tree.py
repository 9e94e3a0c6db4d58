"""The one typed configuration tree of megatron_gspo.

Every default lives here, once (with the model and parallel sections in
:mod:`~megatron_gspo.config.model`, the algorithm's in :mod:`~megatron_gspo.config.algo` and the
rollout's in :mod:`~megatron_gspo.config.rollout`, all importable from :mod:`megatron_gspo.config`, and what they share
in :mod:`~megatron_gspo.config.schema`); where a default comes from a paper or a peer framework
the comment says which. Hydra composes presets (``examples/moe/*.yaml``) and command-line
overrides against this schema (see :mod:`megatron_gspo.config.loader`); the dataclasses below
decide what is valid. Each sub-config validates its own fields in ``__post_init__``;
:class:`TrainConfig` validates the fields that depend on each other.

Every error is a :class:`ConfigError` that says what is wrong, why, and how to fix it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_gspo.config.agent import AgentConfig
from megatron_gspo.config.algo import AlgoConfig
from megatron_gspo.config.judge import JudgeConfig, judge_role_problems
from megatron_gspo.config.model import ModelConfig, ParallelConfig
from megatron_gspo.config.models import ExtraModelConfig, check_models
from megatron_gspo.config.rollout import RolloutConfig
from megatron_gspo.config.schema import (
    ConfigError,
    StartupErrors,
    check_choice,
    check_positive,
    from_dict,
    warn_config,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------------


@dataclass
class OptimConfig:
    """AdamW through Megatron's optimizer, with linear warm-up then constant or cosine decay."""

    lr: float = 3e-3
    """Peak learning rate. 3e-3 suits the tiny CPU demo; the GPU presets use 1e-6."""
    min_lr: float = 0.0
    """Learning rate at the end of a linear or cosine decay."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0."""
    lr_decay_style: str = "constant"
    """constant, linear or cosine decay to min_lr over the run's optimizer steps."""
    max_consecutive_skips: int = 3
    """A step whose loss or grad norm is not finite is skipped (weights and optimizer state
    untouched); this many skips in a row stop the run."""
    max_collapsed_steps: int = 3
    """RL steps in a row whose every optimizer step had a gradient norm of exactly 0 while the
    advantages were not 0 (a collapsed policy: saturated or dead activations, e.g. after a far too
    large lr) that stop the run; 0 never stops (megatron_gspo.runtime.health.CollapseGuard)."""

    def __post_init__(self) -> None:
        check_positive("optim.lr", self.lr)
        check_positive("optim.min_lr", self.min_lr, allow_zero=True)
        check_positive("optim.clip_grad", self.clip_grad, allow_zero=True)
        check_positive("optim.lr_warmup_steps", self.lr_warmup_steps, allow_zero=True)
        check_positive("optim.max_consecutive_skips", self.max_consecutive_skips)
        check_positive("optim.max_collapsed_steps", self.max_collapsed_steps, allow_zero=True)
        check_choice(
            "optim.lr_decay_style",
            self.lr_decay_style,
            ("constant", "linear", "cosine"),
            "these are the supported schedules",
        )
        if self.min_lr > self.lr:
            raise ConfigError(
                "optim.min_lr",
                f"min_lr={self.min_lr} > lr={self.lr}",
                "the schedule decays from lr to min_lr",
                "set min_lr <= lr",
            )


# --------------------------------------------------------------------------------------------
# Reward, data, evaluation, checkpoints, logging
# --------------------------------------------------------------------------------------------


@dataclass
class RewardConfig:
    """Reward functions by name (see megatron_gspo.reward) or by import path ``pkg.mod:fn``."""

    functions: list[str] = field(default_factory=lambda: ["synthetic"])
    """Built-in names (math, exact_match, format, code, synthetic) or import paths
    package.module:function; the reward is their weighted sum. The default is the CPU demo's digit
    reward, meaningful only for the synthetic tasks. A function's signature: README, "Custom reward
    functions"."""
    weights: list[float] = field(default_factory=list)
    """One weight per function; empty means all 1."""
    timeout_s: float = 10.0
    """A reward call that takes longer is counted as a time-out and scores failure_reward."""
    failure_reward: float = 0.0
    """Score of a sample whose reward raised or timed out (counted and logged, never silent)."""
    num_workers: int = 2
    """Reward calls running at the same time (worker processes or threads)."""
    executor: str = "process"
    """process: each worker is a child process, and a call that times out is stopped by killing
    its worker (which is then replaced); thread: workers are threads of the trainer (no start-up
    cost, breakpoint() works), but a timed-out call cannot be stopped and runs on in the
    background."""
    max_failed_steps: int = 3
    """A reward function that fails (raises, times out, returns no finite number) on every sample
    of this many batches in a row (training steps or evaluations) stops the run: its scores
    would all be failure_reward, which carries no signal. 0 never stops."""
    overlong_buffer: int = 0
    """DAPO's soft over-long punishment (arXiv 2503.14476, eq. 13; verl's
    ``reward_model.overlong_buffer``): a response longer than algo.response_length -
    overlong_buffer tokens loses overlong_penalty_factor x (excess / overlong_buffer) of reward,
    the full factor at the limit. 0 disables it (DAPO uses a 4096-token buffer under a 20480-token
    limit). Formula: docs/algorithms.md."""
    overlong_penalty_factor: float = 1.0
    """Largest over-long penalty (at the length limit); DAPO and verl use 1."""
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Keyword options per function, keyed like ``functions``, e.g.
    ``{format: {pattern: '^<answer>.*</answer>$'}, code: {timeout_s: 5}}``; the options each
    built-in accepts are the keyword arguments of its function in megatron_gspo.reward."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """A model-graded reward: a judge model (``models.<role>``) reads each sample through a
    template and answers with a verdict or a score (megatron_gspo/config/judge.py;
    docs/judges.md). Off while ``reward.judge.role`` is null."""

    def __post_init__(self) -> None:
        check_choice(
            "reward.executor",
            self.executor,
            ("process", "thread"),
            "reward calls run in child processes or in threads",
        )
        for name, options in self.options.items():
            if name not in self.functions:
                raise ConfigError(
                    f"reward.options.{name}",
                    f"options for {name!r}, which is not in reward.functions {self.functions}",
                    "options apply to a function that is used",
                    f"add {name!r} to reward.functions or remove its options",
                )
            if not isinstance(options, dict):
                raise ConfigError(
                    f"reward.options.{name}",
                    f"expected a mapping of option names to values, got {options!r}",
                    "options are passed to the function as keyword arguments",
                    f"write reward.options.{name} as key: value pairs",
                )
        if self.weights and len(self.weights) != len(self.functions):
            raise ConfigError(
                "reward.weights",
                f"{len(self.weights)} weights for {len(self.functions)} functions",
                "each function's score is multiplied by its weight",
                "give one weight per function, or none",
            )
        check_positive("reward.timeout_s", self.timeout_s)
        check_positive("reward.max_failed_steps", self.max_failed_steps, allow_zero=True)
        check_positive("reward.num_workers", self.num_workers)
        check_positive("reward.overlong_buffer", self.overlong_buffer, allow_zero=True)
        check_positive("reward.overlong_penalty_factor", self.overlong_penalty_factor)


@dataclass
class DataConfig:
    """Prompt data."""

    task: str = "digit_copy"
    """Built-in synthetic task (digit_copy, digit_reversal, digit_sort) used when train_path is
    null."""
    train_path: Optional[str] = None
    """JSONL or Parquet with a prompt column (and answers/metadata)."""
    eval_path: Optional[str] = None
    """Held-out prompt file for evaluation (the format of train_path). Null: no evaluation set with
    a prompt file; the synthetic task uses its own held-out prompts."""
    prompt_key: str = "prompt"
    """Key (column) of the prompt in the prompt files: a string or chat messages. A dotted path
    reaches into nested objects and Parquet struct columns (``extra_info.question``)."""
    answer_key: str = "answer"
    """Key (column) of the reference answer (optional per row); rewards receive it as ``answer``.
    A dotted path reaches into nested objects: ``reward_model.ground_truth`` reads the layout of
    verl's preprocessed math sets (GSM8K, MATH: chat-message prompts, the answer in the
    ``reward_model`` struct)."""
    tokenizer_path: Optional[str] = None
    """HF tokenizer directory (defaults to model.hf_path); the synthetic tasks bring their own."""
    apply_chat_template: bool = True
    """Render file prompts with the tokenizer's chat template (add_generation_prompt=True); false
    encodes string prompts as they are. The synthetic tasks have a fixed format and ignore it."""
    shuffle: bool = True
    """Shuffle file prompts each epoch (seeded by seed and epoch; resumable)."""
    num_eval_prompts: int = 32
    """Held-out prompts of the synthetic task used for evaluation."""

    def __post_init__(self) -> None:
        check_positive("data.num_eval_prompts", self.num_eval_prompts)
        for name in ("prompt_key", "answer_key"):
            value = getattr(self, name)
            if not value or any(not part for part in value.split(".")):
                raise ConfigError(
                    f"data.{name}",
                    f"{value!r} is not a key or a dotted key path",
                    "it names a column, or a path of keys into nested objects",
                    f"set data.{name} to a column name, e.g. 'prompt' or "
                    "'reward_model.ground_truth'",
                )


TURN_SCHEDULINGS = ("lockstep", "independent")
"""``env.turn_scheduling``: when a trajectory's next turn goes to the engine."""


@dataclass
class EnvConfig:
    """Multi-turn rollouts in an environment (docs/agentic.md): the model's turns alternate with
    the environment's observations (tool outputs), token in and token out."""

    name: Optional[str] = None
    """Built-in environment (single_turn, python_tool, multiply_tool) or an import path
    package.module:Class; null: no environment (one completion per sample)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment (the built-ins': their classes in
    megatron_gspo/envs/), e.g. {tool_timeout_s: 5}."""
    max_turns: int = 4
    """Most model turns of a trajectory; one that has not ended after them is truncated (verl's
    multi_turn.max_assistant_turns, slime's retool max_turns)."""
    max_tokens_per_turn: Optional[int] = None
    """Most tokens of one model turn (a turn cut there truncates its trajectory); null: what is
    left of the response budget. The budget of a whole trajectory, model and observation tokens
    after the prompt, is algo.response_length."""
    num_workers: int = 4
    """Environment steps (tool calls) running at the same time, in threads of the driver."""
    turn_scheduling: str = "lockstep"
    """How episodes take turns (docs/agentic.md, "Turn scheduling"). lockstep: every engine call
    holds one turn of every live trajectory, and the next call waits for all of their
    environment steps (a slow tool call holds up every episode). independent: each trajectory
    goes on as soon as its own step is done; whenever the engine is free it gets one call with
    every trajectory that is ready, while the other steps run (verl's agent loop, slime,
    SkyRL, AReaL). Seeds are per (prompt, sample, turn) in both, so with a batch-invariant
    engine both make the same trajectories."""

    def __post_init__(self) -> None:
        check_positive("env.max_turns", self.max_turns)
        check_positive("env.num_workers", self.num_workers)
        check_choice(
            "env.turn_scheduling",
            self.turn_scheduling,
            TURN_SCHEDULINGS,
            "episodes advance all together (lockstep) or each on its own (independent)",
        )
        if self.max_tokens_per_turn is not None:
            check_positive("env.max_tokens_per_turn", self.max_tokens_per_turn)
        if self.options and self.name is None:
            raise ConfigError(
                "env.options",
                "options given without an environment",
                "options are keyword arguments of the environment named in env.name",
                "set env.name, or remove env.options",
            )


@dataclass
class EvalConfig:
    """Evaluation on held-out prompts: greedy accuracy, mean reward and pass@k."""

    interval: int = 0
    """Evaluate every k steps on held-out prompts; 0 disables."""
    num_samples: int = 4
    """Samples per prompt for pass@k (k <= num_samples)."""
    temperature: float = 1.0
    """Sampling temperature of the pass@k samples (greedy accuracy uses 0)."""
    correct_reward: float = 1.0
    """A held-out response counts as correct (greedy accuracy, pass@k) when its reward reaches
    this value (1.0 is a full score for the built-in tasks and the math reward)."""

    def __post_init__(self) -> None:
        check_positive("eval.interval", self.interval, allow_zero=True)
        check_positive("eval.num_samples", self.num_samples)


@dataclass
class CheckpointConfig:
    """Megatron distributed checkpoints in output_dir/checkpoints (atomic, resumable at any
    layout)."""

    interval: int = 0
    """Save a Megatron distributed checkpoint every k steps (and at the end); 0 disables."""
    keep_last: int = 2
    """Checkpoints kept in output_dir/checkpoints; older ones are deleted after a save."""
    load_path: Optional[str] = None
    """Initialise from this Megatron checkpoint (weights only) instead of model.hf_path/seed."""

    def __post_init__(self) -> None:
        check_positive("checkpoint.interval", self.interval, allow_zero=True)
        check_positive("checkpoint.keep_last", self.keep_last)


@dataclass
class LoggingConfig:
    """Where metrics and messages go. metrics.jsonl is always written (driver only)."""

    tensorboard: bool = True
    """Write TensorBoard events to output_dir/tensorboard."""
    wandb: bool = False
    """Log to Weights & Biases as well (pip install wandb)."""
    wandb_project: str = "megatron_gspo"
    """W&B project of the run."""
    progress_bar: bool = True
    """A progress bar with reward, clip fraction, KL and step time (driver only)."""
    log_level: str = "INFO"
    """Python logging level of the driver (other ranks log warnings only). DEBUG also shows
    Megatron-Core's own INFO messages and its notices about missing kernel libraries."""


@dataclass
class TrainConfig:
    """Root of the tree: ``python -m megatron_gspo.train`` with no arguments runs these defaults,
    the CPU demo (a tiny MoE that learns to repeat 8 random digits: a 20-step supervised cold
    start, then GSPO)."""

    output_dir: str = "outputs/cpu_demo"
    """Where metrics.jsonl, tensorboard/, checkpoints/ and rollout files go (created if missing)."""
    steps: int = 40
    """RL steps (rollout + updates) to run."""
    seed: int = 1234
    """Seeds the initial weights, the prompt order, the mini-batch splits and (unless rollout.seed
    is set) sampling: the same seed and configuration give the same run."""
    resume: bool = False
    """Continue from the latest complete checkpoint in output_dir/checkpoints."""
    overwrite_output_dir: bool = False
    """A fresh run (resume=false) refuses an output_dir that holds another run's metrics or
    checkpoints; true deletes them (metrics.jsonl, tensorboard/, checkpoints/) before starting."""
    sft_warmup_steps: int = 20
    """Supervised cold start before RL: this many optimizer steps of maximum likelihood on the
    data's reference answers (rollout_batch_size prompts each). The GSPO paper also starts RL from
    a cold-start fine-tuned model (section 5.1). Needs answers in the data. The default is the CPU
    demo's (20 steps take the tiny model from reward 0.1 to about 0.3, GSPO does the rest); set 0
    for a model that is already fine-tuned."""
    sft_warmup_lr: Optional[float] = None
    """Learning rate of the supervised cold start's steps; null: optim.lr. Imitation tolerates a
    larger step than RL, whose negative advantages push probability off the sampled tokens
    (the cpu_tool_use preset: 3e-3 for its cold start, 1e-3 for RL, docs/agentic.md). The lr
    schedule (optim.lr_warmup_steps, decay) still counts the cold start's steps."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    models: dict[str, Any] = field(default_factory=dict)
    """Extra models by role name (teacher, judge, ...), each behind its own engine with its own
    weights, never synced from the trainer: role -> the keys of an ``ExtraModelConfig``
    (megatron_gspo/config/models.py; hf_path, engine, dtype, sglang, time limits), e.g.
    ``models.teacher.hf_path=/path/to/hf_dir``; docs/distillation.md. After loading, each value
    is an ``ExtraModelConfig``. (Declared as a mapping of any value because Hydra cannot add a
    key to a mapping of dataclasses from the command line.)"""

    def _check_models(self) -> None:
        """The extra models' sections, and the roles the rest of the run names in them."""
        self.models = {
            role: model
            if isinstance(model, ExtraModelConfig)
            else from_dict(ExtraModelConfig, model, prefix=f"models.{role}.")
            for role, model in self.models.items()
        }
        errors = check_models(self.models)
        errors += judge_role_problems(self.reward.judge, self.models)
        distillation = self.algo.distillation
        if distillation.enabled and distillation.teacher not in self.models:
            errors.append(
                ConfigError(
                    f"models.{distillation.teacher}",
                    f"algo.distillation.mode={distillation.mode} names the teacher "
                    f"{distillation.teacher!r}, which models does not hold "
                    f"(roles: {sorted(self.models) or 'none'})",
                    "the teacher scores the student's tokens through its own engine",
                    f"set models.{distillation.teacher}.hf_path=/path/to/teacher_hf_dir",
                )
            )
        teacher = self.models.get(distillation.teacher) if distillation.enabled else None
        if teacher is not None and teacher.engine == "sglang" and self.rollout.temperature != 1:
            errors.append(
                ConfigError(
                    f"models.{distillation.teacher}.engine",
                    f"an SGLang teacher with rollout.temperature={self.rollout.temperature}",
                    "the teacher must score the student's tokens at the sampling temperature, "
                    "and SGLang 0.5.23 computes prompt log-probs at temperature 1 only",
                    f"set models.{distillation.teacher}.engine=embedded, or rollout.temperature=1",
                )
            )
        if distillation.enabled and self.rollout.replay_dir is not None:
            errors.append(
                ConfigError(
                    "algo.distillation.mode",
                    f"distillation ({distillation.mode}) with rollout.replay_dir",
                    "a replayed run starts no engine, so no teacher scores its batches; "
                    "training on the teacher log-probs a recording carries is not supported",
                    "set algo.distillation.mode=off, or generate (rollout.replay_dir=null)",
                )
            )
        if errors:
            raise errors[0] if len(errors) == 1 else StartupErrors(errors)

    @property
    def requests_rollout_routes(self) -> bool:
        """Whether rollouts return the engine's routes: for R3, which replays them, and for the
        trainer-vs-engine routing metrics (``routing_change_frac_vs_rollout``,
        ``routing_mismatch_vs_rollout``) with ``algo.log_routing_change`` on an embedded engine
        (SGLang servers return routes only when started with --enable-return-routed-experts,
        which R3 and ``rollout.sglang.return_routes`` ask for)."""
        if not self.model.is_moe:
            return False
        if self.rollout.retokenize_responses:
            return False  # the re-encoded tokens have no routes (R3 is refused)
        if self.algo.routing_replay == "r3":
            return True
        return self.algo.log_routing_change and (
            self.rollout.engine != "sglang" or self.rollout.sglang.return_routes
        )

    @property
    def requests_rollout_route_weights(self) -> bool:
        """Whether rollouts also return the combine weights of the engine's routes: R3 with
        ``algo.routing_replay_weights=replayed``, which replays them (the embedded engine)."""
        return (
            self.requests_rollout_routes
            and self.algo.routing_replay == "r3"
            and self.algo.routing_replay_weights == "replayed"
        )

    def _check_retokenization(self) -> None:
        """``rollout.retokenize_responses`` against the rest, every problem at once (the
        tokenizer's kind is a start-up check: it needs the tokenizer loaded)."""
        if not self.rollout.retokenize_responses:
            return
        key = "rollout.retokenize_responses"
        errors = []
        if self.algo.routing_replay == "r3":
            errors.append(
                ConfigError(
                    key,
                    "retokenize_responses=true with algo.routing_replay=r3",
                    "R3 replays the engine's routes of each token, and the engine never routed "
                    "the re-encoded tokens",
                    "set algo.routing_replay=none (or r2), or retokenize_responses=false",
                )
            )
        if self.data.train_path is None:
            errors.append(
                ConfigError(
                    key,
                    f"retokenize_responses=true with the synthetic task {self.data.task!r}",
                    "its tokenizer has one token per symbol, so decoding and encoding again "
                    "gives the same ids: nothing would change",
                    "set data.train_path to a prompt file and data.tokenizer_path to a "
                    "byte-level BPE tokenizer (e.g. python -m megatron_gspo.data.arithmetic_text "
                    "and Qwen's), or retokenize_responses=false",
                )
            )
        if self.env.name is not None or self.agent.function is not None:
            errors.append(
                ConfigError(
                    key,
                    "retokenize_responses=true with "
                    + ("env.name" if self.env.name is not None else "agent.function"),
                    "an episode's response interleaves the model's turns with observations "
                    "that the model did not sample; retokenization applies to one completion "
                    "per sample",
                    "set env.name=null and agent.function=null, or retokenize_responses=false",
                )
            )
        if self.rollout.replay_dir is not None:
            errors.append(
                ConfigError(
                    key,
                    "retokenize_responses=true with rollout.replay_dir",
                    "a replayed run generates nothing; the recorded ids are trained as saved",
                    "record the run with retokenize_responses=true and replay it without, or "
                    "set rollout.replay_dir=null",
                )
            )
        if errors:
            raise errors[0] if len(errors) == 1 else StartupErrors(errors)

    def _check_agent(self) -> None:
        """``agent.*`` against the rest: one source of episodes, and per-turn samples only where
        a step's samples need not be group_size per prompt."""
        agent = self.agent
        if agent.function is not None and self.env.name is not None:
            raise ConfigError(
                "agent.function",
                f"both agent.function and env.name={self.env.name!r} are set",
                "an episode is run either by an environment or by an agent program",
                "remove one of them",
            )
        if agent.per_turn_samples and agent.function is None:
            raise ConfigError(
                "agent.per_turn_samples",
                "per-turn samples without an agent",
                "they split the agent's episodes, which agent.function runs",
                "set agent.function, or remove agent.per_turn_samples",
            )
        if agent.per_turn_samples and (
            self.algo.dynamic_sampling or self.rollout.max_staleness >= 1
        ):
            raise ConfigError(
                "agent.per_turn_samples",
                "per-turn samples with algo.dynamic_sampling or rollout.max_staleness >= 1",
                "both take a step's samples as group_size per prompt; per-turn samples are one "
                "per model turn",
                "set agent.per_turn_samples=false, or turn dynamic sampling off and "
                "rollout.max_staleness=0",
            )

    def __post_init__(self) -> None:
        check_positive("steps", self.steps)
        self._check_models()
        check_positive("sft_warmup_steps", self.sft_warmup_steps, allow_zero=True)
        if self.sft_warmup_lr is not None:
            check_positive("sft_warmup_lr", self.sft_warmup_lr)
        algo, parallel, model = self.algo, self.parallel, self.model
        if algo.samples_per_step % algo.num_mini_batches:
            raise ConfigError(
                "algo.num_mini_batches",
                f"{algo.samples_per_step} samples per step (rollout_batch_size x "
                f"num_return_sequences_in_group) do not split into {algo.num_mini_batches} "
                "equal mini-batches",
                "every optimizer step must see the same number of samples",
                "choose num_mini_batches among the divisors of the samples per step",
            )
        if algo.old_log_prob_source == "detach" and algo.num_mini_batches * algo.ppo_epochs > 1:
            warn_config(
                "algo.old_log_prob_source",
                "detach uses the current policy as the old one, so after the first optimizer step "
                "of a rollout batch the ratio is no longer against the sampling policy; use "
                "recompute or rollout with several mini-batches or epochs",
            )
        if model.is_moe:
            if model.num_experts % parallel.ep:
                raise ConfigError(
                    "parallel.ep",
                    f"ep={parallel.ep} does not divide num_experts={model.num_experts}",
                    "each expert-parallel rank holds num_experts/ep whole experts",
                    "choose ep among the divisors of model.num_experts",
                )
        elif parallel.ep > 1:
            raise ConfigError(
                "parallel.ep",
                f"ep={parallel.ep} with the dense architecture {model.architecture!r}",
                "a dense model has no experts to distribute",
                "set parallel.ep=1",
            )
        if model.num_query_groups % parallel.tp:
            raise ConfigError(
                "parallel.tp",
                f"tp={parallel.tp} does not divide num_query_groups={model.num_query_groups}",
                "tensor parallel splits key/value heads into whole groups per rank",
                "choose tp among the divisors of model.num_query_groups",
            )
        layers_per_chunk = parallel.pp * (parallel.vpp or 1)
        if model.num_layers % layers_per_chunk:
            raise ConfigError(
                "parallel.pp",
                f"num_layers={model.num_layers} is not divisible by pp*vpp={layers_per_chunk}",
                "every pipeline chunk holds the same number of layers",
                "change parallel.pp / parallel.vpp or model.num_layers",
            )
        episodes = self.env.name is not None or self.agent.function is not None
        if not self.reward.functions and not self.reward.judge.enabled and not episodes:
            raise ConfigError(
                "reward.functions",
                "no reward function",
                "every sample needs a score (only an environment can give it without one)",
                "set reward.functions, e.g. [math] or [my_pkg.rewards:score], or a judge "
                "(reward.judge.role)",
            )
        self._check_agent()
        self._check_retokenization()
        if algo.advantage_level == "turn" and not episodes:
            raise ConfigError(
                "algo.advantage_level",
                "per-turn advantages without an environment",
                "turns and their rewards come from an environment's episodes",
                "set env.name, or algo.advantage_level=sequence",
            )
        if self.reward.overlong_buffer > algo.response_length:
            raise ConfigError(
                "reward.overlong_buffer",
                f"{self.reward.overlong_buffer} > algo.response_length={algo.response_length}",
                "the penalty grows over the last overlong_buffer tokens before the length limit",
                "set reward.overlong_buffer <= algo.response_length (0 disables it)",
            )
        if algo.routing_replay != "none" and not model.is_moe:
            raise ConfigError(
                "algo.routing_replay",
                f"routing replay {algo.routing_replay!r} on the dense {model.architecture!r}",
                "routing replay fixes the expert choice of MoE layers",
                "set algo.routing_replay=none",
            )
        if self.rollout.embedded_route_source != "own" and not model.is_moe:
            raise ConfigError(
                "rollout.embedded_route_source",
                f"embedded_route_source={self.rollout.embedded_route_source} on the dense "
                f"{model.architecture!r}",
                "it forces the experts of the engine's MoE routers; a dense model has none",
                "set rollout.embedded_route_source=own",
            )
        if self.data.train_path is not None and "synthetic" in self.reward.functions:
            warn_config(
                "reward.functions",
                f"the synthetic digit reward (the CPU demo's) scores your prompt file "
                f"{self.data.train_path}: it compares response tokens with answer digits, which "
                "means nothing for other data; set reward.functions to a reward for your task, "
                "e.g. [math], [exact_match] or [my_package.rewards:score]",
            )
        if self.rollout.max_staleness and algo.old_log_prob_source == "detach":
            raise ConfigError(
                "algo.old_log_prob_source",
                f"detach with rollout.max_staleness={self.rollout.max_staleness}",
                "detach takes the current policy as the one that sampled, so samples of older "
                "weights would be trained as if fresh (no importance ratio against their policy)",
                "set algo.old_log_prob_source=rollout (the engine's log-probs: GSPO's ratio "
                "corrects the staleness) or recompute (a proximal policy, docs/async.md)",
            )
        if (
            algo.routing_replay == "r3"
            and self.rollout.engine == "sglang"
            and not self.rollout.sglang.launch  # launched servers get the flag
        ):
            warn_config(
                "algo.routing_replay",
                "r3 with SGLang needs servers started with --enable-return-routed-experts and no "
                "router that drops return_routed_experts (sglang-router 0.3.2 does)",
            )
        if (
            algo.routing_replay == "r3"
            and algo.routing_replay_weights == "replayed"
            and self.rollout.engine != "embedded"
            and self.rollout.replay_dir is None
        ):
            raise ConfigError(
                "algo.routing_replay_weights",
                f"replayed with routing_replay=r3 and rollout.engine={self.rollout.engine}",
                "R3 replays the rollout engine's combine weights, which only the in-process "
                "embedded engine reports (SGLang's return_routed_experts returns expert ids "
                "only, and the SGLang protocol that embedded_http speaks carries no weights)",
                "set rollout.engine=embedded, or algo.routing_replay_weights=recompute (replay "
                "the engine's ids, weights from the router being trained), or "
                "algo.routing_replay=r2 (replay the old forward's ids and weights)",
            )

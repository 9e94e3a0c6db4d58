"""The rollout section of the configuration (``rollout.*``): engines, sampling, weight
transports and asynchronous training; part of the one configuration tree,
:mod:`megatron_gspo.config`, whose rules hold here: every default lives here once, with its
source. An engine's own knobs are a nested section in the engine's module
(``rollout.sglang``: :mod:`megatron_gspo.config.sglang`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_gspo.config.schema import ConfigError, check_choice, check_positive, warn_config
from megatron_gspo.config.sglang import SGLangConfig

# --------------------------------------------------------------------------------------------
# Rollout
# --------------------------------------------------------------------------------------------


ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")
ROLLOUT_ENGINES = ("embedded", "embedded_http", "sglang")
"""What ``rollout.engine`` may name; each is built by its builder in
:data:`megatron_gspo.rollout.factory.ENGINE_BUILDERS`."""
EMBEDDED_MAX_BATCH_SIZE = 64
EMBEDDED_ROUTE_SOURCES = ("own", "float32_twin")
"""What ``rollout.embedded_route_source`` may name."""
"""``rollout.embedded_max_batch_size``'s default: the embedded engine's batch size."""


@dataclass
class RolloutConfig:
    """Where samples come from."""

    engine: str = "embedded"
    """embedded (the policy as a transformers model in the trainer process, the default and the
    CPU path), embedded_http (the same engine behind a loopback HTTP server, driven through the
    SGLang client) or sglang (SGLang servers)."""
    dtype: str = "float32"
    """Parameter and compute dtype of the embedded engines (``embedded``, ``embedded_http``):
    float32 (the default: an exact twin of the fp32 trainer, train/rollout k3 KL about 1e-13),
    bfloat16 or float16. Weights are cast when they are synced, and the whole forward, MoE router
    included, runs in that dtype, as SGLang's does, so the engine's log-probs and routes really
    differ from the trainer's (the training-inference mismatch of real runs; see
    docs/algorithms.md). Logits come out of the output layer in this dtype and the log-softmax is
    taken in float32, as SGLang's logits processor and sampler do. SGLang picks its own dtype
    (its ``--dtype``, in ``sglang.extra_args``), so this must stay float32 with engine=sglang."""
    embedded_max_batch_size: int = EMBEDDED_MAX_BATCH_SIZE
    """Most samples the embedded engines (``embedded``, ``embedded_http``) decode together; a
    longer list of requests runs in several batches, grouped by prompt length. The batch a
    sample shares changes its logits by float rounding (left padding changes the lengths of the
    attention's reductions, the matmuls see other shapes): the batch variance of real inference
    servers, one source of the training-inference mismatch. 1 decodes every sample alone (no
    padding); ``tools/compare_grpo_gspo.py --suite attribution`` measures what it changes
    (docs/compare_grpo_gspo.md, "Mismatch attribution"). SGLang batches as its scheduler
    decides, so this stays at its default with engine=sglang."""
    embedded_route_source: str = "own"
    """Whose experts the MoE routers of the embedded engines (``embedded``, ``embedded_http``)
    use: own (the default: the engine's routers choose, in rollout.dtype) or float32_twin. With
    float32_twin the engine keeps a float32 copy of the model (built from the same weights,
    loaded by every weight sync) that runs first at every forward (the prefill and each decode
    step, with a KV cache of its own); its routers' top-k experts are forced in the engine's
    routers, whose weights the engine's router recomputes over them (as Megatron's routing
    replay does), and the routes the engine reports are these. A float32 forward agrees with
    the fp32 trainer to float rounding, so these are the trainer's routes: a bfloat16 / float16
    engine then keeps its precision's mismatch without the routing flips (the reverse of
    algo.routing_replay=r3; tools/compare_grpo_gspo.py --suite attribution, source
    bf16_trainer_routes, docs/compare_grpo_gspo.md, "Mismatch attribution"). Costs a float32
    copy of the model and its forward at every step. With rollout.dtype=float32 both choose
    alike and generation is unchanged, bit for bit. MoE models only; not with engine=sglang."""
    temperature: float = 1.0
    """Sampling temperature; training log-probs are computed at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 samples from the whole distribution (below 1 warns)."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 disables (above 0 warns)."""
    min_new_tokens: int = 0
    """Stop tokens (the tokenizer's EOS included) cannot be sampled before a response has this
    many tokens (SGLang's ``min_new_tokens``); at ``>= algo.response_length`` every response is
    exactly ``response_length`` tokens long (fixed-length benchmarks, ``benchmarks/vs_trl.py``).
    The embedded engine masks them for sampling only and still reports the log-probs of the
    unmasked distribution, which is what the trainer computes (so ``old_log_prob_source=rollout``
    stays consistent)."""
    seed: Optional[int] = None
    """Sampling seed; null derives it from the run seed and step."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """The SGLang engine's servers: listed, or launched and how (rollout.engine=sglang)."""
    weight_transport: str = "tensor"
    """How weights reach SGLang: tensor (colocated, update_weights_from_tensor), distributed
    (NCCL broadcast, update_weights_from_distributed) or disk (safetensors +
    update_weights_from_disk)."""
    weight_bucket_mb: int = 512
    """Upper bound of one weight-sync bucket."""
    weight_sync_address: Optional[str] = None
    """weight_transport=distributed: the driver's address that the SGLang servers connect to (the
    update group's rendezvous; the driver is rank 0 of that group). null: this machine's address
    on the route to the first server (127.0.0.1 for servers on this machine)."""
    weight_sync_port: int = 0
    """weight_transport=distributed: the rendezvous port on weight_sync_address; 0 picks a free
    one at the first sync."""
    request_timeout_s: float = 600.0
    """Time limit of one /generate call to an SGLang server."""
    max_retries: int = 3
    """Retries of a request that failed in transport (connection refused or reset), with doubling
    backoff."""
    max_concurrency: int = 256
    """Most /generate calls in flight over all servers."""
    max_staleness: int = 0
    """Asynchronous training (docs/async.md): the rollout engine keeps generating the next steps'
    samples while the trainer updates, and a sample trained at weight version ``v`` was generated
    entirely by versions ``>= v - max_staleness``; groups that would exceed it are generated
    again (counted), never trained stale or dropped. 0 is the synchronous loop (generation, then
    the update). Peers: AReaL ``max_head_offpolicyness``, NeMo-RL ``max_trajectory_age_steps``,
    miles ``--max-weight-staleness``, TRL ``max_staleness``; 1 (one step off-policy) is their
    common choice."""
    partial_rollouts: bool = True
    """With max_staleness >= 1: a weight sync does not wait for the requests in flight; they are
    paused in place, the weights are swapped between two decode steps and they continue, each
    token carrying the version that sampled it (slime ``--partial-rollout``, verl
    ``async_training.partial_rollout``, NeMo-RL ``in_flight_weight_updates``). false: the sync
    waits until the requests in flight have finished, so every sample has one version."""
    embedded_server_process: bool = False
    """rollout.engine=embedded_http: run the loopback server in a child process of its own
    (``python -m megatron_gspo.rollout.server``) instead of a thread of the trainer. Generation
    then runs beside training without sharing the trainer's Python interpreter lock (what makes
    asynchronous training overlap on a CPU), and a server that dies is restarted."""
    engine_threads: Optional[int] = None
    """torch threads of the child server process (rollout.embedded_server_process); null: torch's
    default (every core). On a machine where trainer and engine share few cores, 1 each avoids
    oversubscription (docs/async.md)."""
    producer_processes: int = 0
    """With max_staleness >= 1: processes that make samples from the engine's answers (episode
    stepping, an agent's episodes behind a chat endpoint of the process's own, answer decoding,
    reward dispatch, sample building), each producing one chunk of
    rollout_batch_size prompts at a time, so that this per-sample Python work runs beside the
    trainer instead of under its interpreter lock; chunks in flight at once are at most this many
    (and the staleness bound's). 0: one producer thread in the trainer process. Needs an engine
    reachable over HTTP (embedded_http, sglang; docs/async.md)."""
    engine_restart_timeout_s: float = 120.0
    """How long a rollout engine that stopped answering may take to come back (a server this run launched is restarted, another is waited for) and to take the current
    weights again (from the disk weight transport's newest files); past it the run saves a
    checkpoint and stops (exit 3). Its lost requests are generated again."""
    save_rollouts: bool = False
    """Write each step's rollout batch (token ids, behaviour log-probs, routes, rewards, weight
    versions) to output_dir/rollouts/step_<step>.safetensors, for rollout.replay_dir
    (docs/rollout-replay.md)."""
    replay_dir: Optional[str] = None
    """Train on the batches a run recorded (its output_dir, or its rollouts/ folder) instead of
    generating: no rollout engine, reward function or environment runs, and the weight syncs go
    nowhere. The same samples fed to another loss, layout or precision; with the recording's
    settings, its metrics again, bit for bit (docs/rollout-replay.md)."""
    retokenize_responses: bool = False
    """A mismatch-attribution knob that reproduces what naive agent harnesses do: every generated
    response is decoded to text and encoded again with the run's tokenizer, and the run trains
    on the re-encoded ids (which can differ: the engine may sample a token path the encoder
    would not write, and bytes that are not valid UTF-8 come back as U+FFFD). The engine's
    log-probs are carried to the new tokens on byte offsets: an unchanged piece keeps them, a
    changed one gets its original total spread over its new tokens (the sequence's log-prob is
    kept exactly; megatron_gspo/data/retokenization.py). Logs ``retokenized_frac_seq`` and
    ``retokenized_frac_token``; a re-encoded response can be longer than
    algo.response_length. Needs a byte-level BPE tokenizer and a prompt file (the synthetic
    tokenizer's decode-then-encode is the identity), one completion per sample (no env.name or
    agent.function), no R3 (the engine never routed the new tokens; routes are not requested);
    ``tools/compare_grpo_gspo.py --suite attribution --sources retokenize``
    (docs/compare_grpo_gspo.md, "Mismatch attribution")."""

    def __post_init__(self) -> None:
        check_choice(
            "rollout.engine", self.engine, ROLLOUT_ENGINES, "these are the rollout engines"
        )
        check_choice(
            "rollout.dtype",
            self.dtype,
            ROLLOUT_DTYPES,
            "the embedded engine runs in float32, bfloat16 or float16",
        )
        check_choice(
            "rollout.weight_transport",
            self.weight_transport,
            ("tensor", "distributed", "disk"),
            "SGLang takes weights from tensors, a broadcast group or disk",
        )
        check_positive("rollout.embedded_max_batch_size", self.embedded_max_batch_size)
        if self.engine == "sglang" and self.embedded_max_batch_size != EMBEDDED_MAX_BATCH_SIZE:
            raise ConfigError(
                "rollout.embedded_max_batch_size",
                f"embedded_max_batch_size={self.embedded_max_batch_size} with engine=sglang",
                "it sizes the embedded engine's batches; SGLang's scheduler forms its own",
                f"leave rollout.embedded_max_batch_size at {EMBEDDED_MAX_BATCH_SIZE}, or use an "
                "embedded engine",
            )
        check_choice(
            "rollout.embedded_route_source",
            self.embedded_route_source,
            EMBEDDED_ROUTE_SOURCES,
            "the embedded engine's routers choose, or a float32 twin chooses for them",
        )
        if self.engine == "sglang" and self.embedded_route_source != "own":
            raise ConfigError(
                "rollout.embedded_route_source",
                f"embedded_route_source={self.embedded_route_source} with engine=sglang",
                "the float32 twin that chooses the experts is part of the embedded engine; "
                "SGLang's routers choose for themselves",
                "use rollout.engine=embedded or embedded_http, or "
                "rollout.embedded_route_source=own",
            )
        check_positive("rollout.temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(
                "rollout.top_p",
                f"{self.top_p} is outside (0, 1]",
                "top-p is a probability mass",
                "set 0 < top_p <= 1",
            )
        if self.top_p < 1 or self.top_k > 0:
            warn_config(
                "rollout.top_p/top_k",
                "top-p/top-k sampling: rollout log-probs are computed before truncation (SGLang "
                "semantics) but samples come from the truncated distribution, which biases the "
                "importance ratio",
            )
        check_positive("rollout.min_new_tokens", self.min_new_tokens, allow_zero=True)
        check_positive("rollout.weight_bucket_mb", self.weight_bucket_mb)
        if not 0 <= self.weight_sync_port <= 65535:
            raise ConfigError(
                "rollout.weight_sync_port",
                f"{self.weight_sync_port} is not a TCP port",
                "the SGLang servers connect to the driver on this port",
                "set 0 <= weight_sync_port <= 65535 (0: a free port)",
            )
        check_positive("rollout.request_timeout_s", self.request_timeout_s)
        check_positive("rollout.max_retries", self.max_retries, allow_zero=True)
        check_positive("rollout.max_staleness", self.max_staleness, allow_zero=True)
        check_positive("rollout.producer_processes", self.producer_processes, allow_zero=True)
        if self.producer_processes and not self.max_staleness:
            raise ConfigError(
                "rollout.producer_processes",
                f"producer_processes={self.producer_processes} with max_staleness=0",
                "the producer processes work ahead of training; the synchronous loop has none",
                "set rollout.max_staleness >= 1, or rollout.producer_processes=0",
            )
        if self.producer_processes and self.engine == "embedded":
            raise ConfigError(
                "rollout.producer_processes",
                f"producer_processes={self.producer_processes} with rollout.engine=embedded",
                "the embedded engine lives in the trainer process, which other processes cannot "
                "call",
                "set rollout.engine=embedded_http (with rollout.embedded_server_process=true) "
                "or sglang, or rollout.producer_processes=0",
            )
        check_positive(
            "rollout.engine_restart_timeout_s", self.engine_restart_timeout_s, allow_zero=True
        )
        if self.embedded_server_process and self.engine != "embedded_http":
            raise ConfigError(
                "rollout.embedded_server_process",
                f"embedded_server_process=true with rollout.engine={self.engine!r}",
                "only the loopback server of engine embedded_http runs in a process of its own",
                "set rollout.engine=embedded_http, or rollout.embedded_server_process=false",
            )
        if self.engine_threads is not None:
            check_positive("rollout.engine_threads", self.engine_threads)
            if not self.embedded_server_process:
                raise ConfigError(
                    "rollout.engine_threads",
                    f"engine_threads={self.engine_threads} without a server process",
                    "it sets the torch threads of the child server process",
                    "set rollout.embedded_server_process=true, or rollout.engine_threads=null",
                )
        # Each engine's section checks itself against the keys here (dtype, sampling).
        self.sglang.check_against(
            engine=self.engine, dtype=self.dtype, min_new_tokens=self.min_new_tokens
        )

"""The rollout section of the configuration (``rollout.*``): engines, sampling, SGLang servers,
weight transports and asynchronous training; part of the one configuration tree,
:mod:`megatron_gspo.config`, whose rules hold here: every default lives here once, with its
source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_gspo.config_schema import (
    ConfigError,
    _check_choice,
    _check_positive,
    _is_loopback,
    _warn,
)

# --------------------------------------------------------------------------------------------
# Rollout
# --------------------------------------------------------------------------------------------


ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")


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
    (its ``--dtype``, in ``sglang_extra_args``), so this must stay float32 with engine=sglang."""
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
    sglang_urls: list[str] = field(default_factory=list)
    """Existing SGLang servers (http://host:port); empty means launch them."""
    sglang_launch: bool = False
    """Launch SGLang servers with ``python -m sglang.launch_server``."""
    sglang_python: str = ""
    """Interpreter that launched servers run (``<venv>/bin/python`` of SGLang's own virtual
    environment, whose pins may conflict with the trainer's); empty: the trainer's interpreter."""
    sglang_return_routes: bool = False
    """Ask SGLang for every sample's routed experts also without R3, for the trainer-vs-engine
    routing metrics (``routing_mismatch_vs_rollout``, with ``algo.log_routing_change``); launched
    servers then start with --enable-return-routed-experts, listed ones must have it. Off: SGLang
    returns routes only for R3 (the buffers cost server memory)."""
    sglang_host: str = "127.0.0.1"
    """Address launched SGLang servers listen on. They require the run's API key, but plain HTTP
    carries it (and the weights) unencrypted: any other address than loopback warns at start."""
    sglang_port: int = 30000
    """Port of the first launched server; server i listens on sglang_port + i."""
    sglang_tp: int = 1
    """Tensor parallel size of each launched server (its --tp-size); server i uses the GPUs from i *
    sglang_tp."""
    sglang_ep: int = 1
    """Expert parallel size of each launched server (its --ep-size); divides sglang_tp."""
    sglang_mem_fraction: float = 0.7
    """SGLang's --mem-fraction-static: the share of each GPU's memory that SGLang takes for its
    weights and KV cache. Colocated with the trainer, it must leave room for the trainer's
    resident weights, gradients and optimizer state."""
    sglang_extra_args: list[str] = field(default_factory=list)
    """More arguments for launched servers (SGLang ServerArgs flags); flags set from the keys above
    may not be repeated here."""
    sglang_release_memory: bool = False
    """Colocated layout (SGLang on the trainer's GPUs): release SGLang's GPU memory (weights, KV
    cache, CUDA graphs) with /release_memory_occupation after each rollout, so that log-probs and
    the update can use it, and resume it before the next weight sync (slime's --offload-rollout).
    The servers must run with --enable-memory-saver (examples/moe/sglang_server.sh adds it)."""
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
    engine_restart_timeout_s: float = 120.0
    """With max_staleness >= 1: how long a rollout engine that stopped answering may take to come
    back (a server this run launched is restarted, another is waited for) and to take the current
    weights again (from the disk weight transport's newest files); past it the run saves a
    checkpoint and stops (exit 3). Its lost requests are generated again."""

    def __post_init__(self) -> None:
        _check_choice(
            "rollout.engine",
            self.engine,
            ("embedded", "embedded_http", "sglang"),
            "these are the rollout engines",
        )
        _check_choice(
            "rollout.dtype",
            self.dtype,
            ROLLOUT_DTYPES,
            "the embedded engine runs in float32, bfloat16 or float16",
        )
        if self.engine == "sglang" and self.dtype != "float32":
            raise ConfigError(
                "rollout.dtype",
                f"rollout.dtype={self.dtype!r} with rollout.engine='sglang'",
                "rollout.dtype sets the embedded engine's precision; SGLang servers choose their "
                "own (bfloat16 for bf16 checkpoints by default)",
                "leave rollout.dtype=float32 and pass '--dtype' through rollout.sglang_extra_args",
            )
        _check_choice(
            "rollout.weight_transport",
            self.weight_transport,
            ("tensor", "distributed", "disk"),
            "SGLang takes weights from tensors, a broadcast group or disk",
        )
        _check_positive("rollout.temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(
                "rollout.top_p",
                f"{self.top_p} is outside (0, 1]",
                "top-p is a probability mass",
                "set 0 < top_p <= 1",
            )
        if self.top_p < 1 or self.top_k > 0:
            _warn(
                "rollout.top_p/top_k",
                "top-p/top-k sampling: rollout log-probs are computed before truncation (SGLang "
                "semantics) but samples come from the truncated distribution, which biases the "
                "importance ratio",
            )
        _check_positive("rollout.min_new_tokens", self.min_new_tokens, allow_zero=True)
        _check_positive("rollout.weight_bucket_mb", self.weight_bucket_mb)
        if not 0 <= self.weight_sync_port <= 65535:
            raise ConfigError(
                "rollout.weight_sync_port",
                f"{self.weight_sync_port} is not a TCP port",
                "the SGLang servers connect to the driver on this port",
                "set 0 <= weight_sync_port <= 65535 (0: a free port)",
            )
        if self.engine == "sglang" and self.min_new_tokens > 0:
            raise ConfigError(
                "rollout.min_new_tokens",
                f"min_new_tokens={self.min_new_tokens} with rollout.engine=sglang",
                "SGLang 0.5.23 refuses min_new_tokens on servers without a tokenizer (the "
                "trainer's servers run --skip-tokenizer-init: HTTP 400), and with a tokenizer it "
                "reports the log-probs of the stop-masked distribution for the first "
                "min_new_tokens tokens, which the trainer does not recompute (docs/sglang-"
                "protocol.md)",
                "set rollout.min_new_tokens=0, or use rollout.engine=embedded",
            )
        _check_positive("rollout.request_timeout_s", self.request_timeout_s)
        _check_positive("rollout.max_retries", self.max_retries, allow_zero=True)
        _check_positive("rollout.max_staleness", self.max_staleness, allow_zero=True)
        _check_positive(
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
            _check_positive("rollout.engine_threads", self.engine_threads)
            if not self.embedded_server_process:
                raise ConfigError(
                    "rollout.engine_threads",
                    f"engine_threads={self.engine_threads} without a server process",
                    "it sets the torch threads of the child server process",
                    "set rollout.embedded_server_process=true, or rollout.engine_threads=null",
                )
        if not 0 < self.sglang_mem_fraction < 1:
            raise ConfigError(
                "rollout.sglang_mem_fraction",
                f"{self.sglang_mem_fraction} is outside (0, 1)",
                "it is the share of each GPU's memory that SGLang reserves",
                "set 0 < sglang_mem_fraction < 1 (0.7 on dedicated GPUs, lower when colocated)",
            )
        if self.engine == "sglang" and self.sglang_launch and not _is_loopback(self.sglang_host):
            _warn(
                "rollout.sglang_host",
                f"{self.sglang_host!r} is not a loopback address: the SGLang servers this run "
                "launches are reachable from other machines. They refuse calls without the "
                "run's API key, but HTTP carries that key and the weights unencrypted; keep "
                "sglang_host=127.0.0.1 unless other nodes must reach the servers, and then "
                "only on a private cluster network",
            )
        if self.sglang_release_memory and self.engine != "sglang":
            raise ConfigError(
                "rollout.sglang_release_memory",
                f"sglang_release_memory=true with rollout.engine={self.engine!r}",
                "only SGLang servers hold GPU memory of their own to release; the embedded "
                "engines live in the trainer's process",
                "set rollout.sglang_release_memory=false, or rollout.engine=sglang",
            )

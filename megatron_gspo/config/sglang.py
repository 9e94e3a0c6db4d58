"""The SGLang engine's section of the configuration (``rollout.sglang.*``): which servers, or how
to launch them; part of the one configuration tree, :mod:`megatron_gspo.config`, whose rules hold
here: every default lives here once, with its source.

The engine builds itself from this section (:mod:`megatron_gspo.rollout.sglang_engine`), and its
start-up check reads it; rollout-wide keys (time limits, the weight transport) stay in
``rollout.*``. Another engine gets a section module like this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gspo.config.schema import ConfigError, is_loopback_host, warn_config

KEY = "rollout.sglang"
"""Where this section sits in the tree (the prefix of its keys in messages)."""


@dataclass
class SGLangConfig:
    """SGLang servers (``rollout.engine=sglang``): the servers to use, or those to launch and how
    they start."""

    urls: list[str] = field(default_factory=list)
    """Existing SGLang servers (http://host:port); empty means launch them."""
    launch: bool = False
    """Launch SGLang servers with ``python -m sglang.launch_server``."""
    python: str = ""
    """Interpreter that launched servers run (``<venv>/bin/python`` of SGLang's own virtual
    environment, whose pins may conflict with the trainer's); empty: the trainer's interpreter."""
    return_routes: bool = False
    """Ask SGLang for every sample's routed experts also without R3, for the trainer-vs-engine
    routing metrics (``routing_mismatch_vs_rollout``, with ``algo.log_routing_change``); launched
    servers then start with --enable-return-routed-experts, listed ones must have it. Off: SGLang
    returns routes only for R3 (the buffers cost server memory)."""
    host: str = "127.0.0.1"
    """Address launched SGLang servers listen on. They require the run's API key, but plain HTTP
    carries it (and the weights) unencrypted: any other address than loopback warns at start."""
    port: int = 30000
    """Port of the first launched server; server i listens on port + i."""
    tp: int = 1
    """Tensor parallel size of each launched server (its --tp-size); server i uses the GPUs from i *
    tp."""
    ep: int = 1
    """Expert parallel size of each launched server (its --ep-size); divides tp."""
    mem_fraction: float = 0.7
    """SGLang's --mem-fraction-static: the share of each GPU's memory that SGLang takes for its
    weights and KV cache. Colocated with the trainer, it must leave room for the trainer's
    resident weights, gradients and optimizer state."""
    extra_args: list[str] = field(default_factory=list)
    """More arguments for launched servers (SGLang ServerArgs flags); flags set from the keys above
    may not be repeated here."""
    release_memory: bool = False
    """Colocated layout (SGLang on the trainer's GPUs): release SGLang's GPU memory (weights, KV
    cache, CUDA graphs) with /release_memory_occupation after each rollout, so that log-probs and
    the update can use it, and resume it before the next weight sync (slime's --offload-rollout).
    The servers must run with --enable-memory-saver (examples/moe/sglang_server.sh adds it)."""

    def __post_init__(self) -> None:
        if not 0 < self.mem_fraction < 1:
            raise ConfigError(
                f"{KEY}.mem_fraction",
                f"{self.mem_fraction} is outside (0, 1)",
                "it is the share of each GPU's memory that SGLang reserves",
                "set 0 < mem_fraction < 1 (0.7 on dedicated GPUs, lower when colocated)",
            )

    def check_against(self, *, engine: str, dtype: str, min_new_tokens: int) -> None:
        """The checks of this section against the rest of ``rollout.*`` (called by
        :class:`~megatron_gspo.config.RolloutConfig`, which holds it, with its keys)."""
        if engine != "sglang":
            if self.release_memory:
                raise ConfigError(
                    f"{KEY}.release_memory",
                    f"release_memory=true with rollout.engine={engine!r}",
                    "only SGLang servers hold GPU memory of their own to release; the embedded "
                    "engines live in the trainer's process",
                    f"set {KEY}.release_memory=false, or rollout.engine=sglang",
                )
            return
        if dtype != "float32":
            raise ConfigError(
                "rollout.dtype",
                f"rollout.dtype={dtype!r} with rollout.engine='sglang'",
                "rollout.dtype sets the embedded engine's precision; SGLang servers choose their "
                "own (bfloat16 for bf16 checkpoints by default)",
                f"leave rollout.dtype=float32 and pass '--dtype' through {KEY}.extra_args",
            )
        if min_new_tokens > 0:
            raise ConfigError(
                "rollout.min_new_tokens",
                f"min_new_tokens={min_new_tokens} with rollout.engine=sglang",
                "SGLang 0.5.23 refuses min_new_tokens on servers without a tokenizer (the "
                "trainer's servers run --skip-tokenizer-init: HTTP 400), and with a tokenizer it "
                "reports the log-probs of the stop-masked distribution for the first "
                "min_new_tokens tokens, which the trainer does not recompute (docs/sglang-"
                "protocol.md)",
                "set rollout.min_new_tokens=0, or use rollout.engine=embedded",
            )
        if self.launch and not is_loopback_host(self.host):
            warn_config(
                f"{KEY}.host",
                f"{self.host!r} is not a loopback address: the SGLang servers this run "
                "launches are reachable from other machines. They refuse calls without the "
                "run's API key, but HTTP carries that key and the weights unencrypted; keep "
                f"{KEY}.host=127.0.0.1 unless other nodes must reach the servers, and then "
                "only on a private cluster network",
            )

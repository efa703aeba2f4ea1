"""The reward-model trainer's config (``python -m megarl.train_rm``): one dataclass per section,
loaded like the RL trainer's (YAML recipe + ``key=value`` overrides, unknown keys refused).

The model and parallel sections are the RL trainer's own (:class:`ParallelConfig`,
:class:`OptimSettings`), so a reward model trains at the layouts and with the optimizer the
policy does."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megarl.config.schema import COUNT, COUNT0, SEED, OptimSettings, ParallelConfig, Range, setting


@dataclass
class RMModelConfig:
    """What the score model starts from and reads with."""

    #: an HF causal LM (its trunk, with a zero-initialised score head) or a reward model already
    #: (*ForSequenceClassification / *ForTokenClassification, num_labels=1) trained further
    path: str = "???"
    tokenizer: Optional[str] = None  # default: model.path
    chat_template: Optional[str] = None  # a Jinja file rendering (prompt, response) (default: its tokenizer's)
    vocab_multiple: int = setting(128, range=COUNT)  # embedding rows padded to a multiple of this (x tp)


@dataclass
class RMDataConfig:
    """Preference pairs: JSONL rows with ``chosen`` and ``rejected`` (each a response text, or a
    whole chat as a list of messages) and, for texts, the ``prompt`` (a text or messages)."""

    train_path: str = "???"
    heldout_path: Optional[str] = None  # held-out pairs: their accuracy is the metric (null: none)
    #: a pair whose longer rendering exceeds this many tokens is refused at load, naming its line
    max_tokens: int = setting(512, range=COUNT)
    #: a reference-guided model's user turn: a format string with {prompt} (the turn's text) and the
    #: row's other fields (e.g. "{prompt} answer : {answer}"); recorded in the export, and what
    #: reward.models[i].prompt must then say.  null: the prompt as it is
    prompt: Optional[str] = None
    #: the built-in pairs (megarl/builtin/preference_pairs.py) are written to the paths first when
    #: they are missing: "arithmetic" (right answers over near misses) or null (use the files)
    builtin: Optional[str] = setting(None, choices=("arithmetic", None))
    builtin_train_n: int = setting(4000, range=COUNT)  # pairs written to train_path by the built-in builder
    builtin_heldout_n: int = setting(400, range=COUNT)  # pairs written to heldout_path by the built-in builder


@dataclass
class RMTrainerConfig:
    """Steps, batches, evaluation, checkpoints and export of a reward-model run."""

    steps: int = setting(100, range=COUNT)  # optimizer steps
    pairs_per_step: int = setting(32, range=COUNT)  # the global batch (pairs over all DP ranks)
    micro_batch_pairs: int = setting(0, range=COUNT0)  # pairs per forward/backward per DP rank (0: all at once)
    seed: int = setting(1234, range=SEED)  # of the pair order
    #: the reward-centering term's weight: coef * (s_chosen + s_rejected)^2 per pair, pulling each
    #: pair's mean score to 0 so scores compare across prompts (megarl/algo/preference.py); 0: off
    center_rewards_coef: float = setting(0.0, range=Range(lo=0))
    run_dir: Optional[str] = None  # default runs/<recipe>-<timestamp>
    eval_every: int = setting(20, range=COUNT0)  # held-out pair accuracy every this many steps (0: at the end only)
    checkpoint_every: int = setting(0, range=COUNT0)  # steps between training-position checkpoints (0: at the end)
    checkpoint_keep: int = setting(2, range=COUNT)
    #: auto: continue from <run_dir>/checkpoints/latest if there is one | never: refuse a run dir with one
    resume: str = setting("auto", choices=("auto", "never"))
    loggers: list = field(default_factory=lambda: ["jsonl", "tensorboard"])  # jsonl is always on
    #: the export's dtype (null: the source checkpoint's)
    export_dtype: Optional[str] = setting(None, choices=("float32", "bfloat16", "float16", None))
    #: stop after this many steps as if killed (a test of exact resume); null: never
    stop_after: Optional[int] = setting(None, range=Range(lo=1, null=True))


@dataclass
class RMTrainConfig:
    """A Bradley-Terry reward-model run (``python -m megarl.train_rm``)."""

    recipe: str = "custom"
    model: RMModelConfig = field(default_factory=RMModelConfig)
    data: RMDataConfig = field(default_factory=RMDataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimSettings = field(default_factory=lambda: OptimSettings(lr=1.0e-5))
    trainer: RMTrainerConfig = field(default_factory=RMTrainerConfig)


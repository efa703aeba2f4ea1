"""``python -m megarl.train_rm``: the checks before any model loads, then the run.

Everything that can be wrong with the input is said before a weight is read: a key out of its
range, a layout that does not fit the world, a model whose head is neither a causal LM's nor a
reward model's, a pair file that is missing or lacks ``chosen`` / ``rejected`` (with its line),
a pair longer than ``data.max_tokens``.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from megarl.errors import ConfigError, MegarlError


def check_rm_config(cfg, world: int) -> int:
    """Ranges, choices, the layout and the model's head; returns the data-parallel size."""
    from megarl.config.ranges import declared_choices, declared_ranges, lookup, range_errors
    from megarl.config.rm_schema import RMTrainConfig
    from megarl.models.hf_config import ModelConfigError, load_spec
    from megarl.roles.score_model import HEADS
    from megarl.runtime.distributed import ParallelLayout

    for key, msg in range_errors(cfg, declared_ranges(RMTrainConfig)):
        raise ConfigError(f"{key}: {msg}")
    if cfg.data.prompt is not None:
        from megarl.rewards.verdicts import check_context_template

        try:
            check_context_template(cfg.data.prompt, "data.prompt")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    for key, choices in declared_choices(RMTrainConfig).items():
        _, v = lookup(cfg, key)
        for item in (v if isinstance(v, list) else [v]):
            if item not in choices:
                raise ConfigError(f"{key}: {item!r} is not one of {list(choices)}")
    p = cfg.parallel
    dp = ParallelLayout(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp).validate(world)
    if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        raise ConfigError(f"model.path: {cfg.model.path} has no config.json (an HF causal LM or reward model expected)")
    try:
        spec = load_spec(cfg.model.path)
    except ModelConfigError as e:
        raise ConfigError(f"model.path: {e}") from None
    if not spec.architecture.endswith(HEADS):
        raise ConfigError(f"model.path: {cfg.model.path} is {spec.architecture}; expected a causal LM (*ForCausalLM, "
                          "trained with a new score head) or a reward model (*ForSequenceClassification / "
                          "*ForTokenClassification, num_labels=1)")
    if cfg.trainer.pairs_per_step % dp:
        raise ConfigError(f"trainer.pairs_per_step: {cfg.trainer.pairs_per_step} pairs do not split over dp={dp} "
                          "data-parallel ranks (a multiple of dp expected)")
    return dp


def load_pairs(cfg):
    """The rendered train and held-out pairs, and the train file's sha256 (what a resume must share)."""
    from megarl.reward_training.loop import RMData
    from megarl.data.preference import read_pairs, render_pairs
    from megarl.data.tokenizer import TokenizerContract
    from megarl.hashing import file_sha256

    contract = TokenizerContract.load(cfg.model.tokenizer or cfg.model.path, cfg.model.chat_template)
    d = cfg.data
    train = render_pairs(contract, read_pairs(d.train_path, "data.train_path"), d.max_tokens, "data.max_tokens",
                         d.prompt)
    heldout = (render_pairs(contract, read_pairs(d.heldout_path, "data.heldout_path"), d.max_tokens, "data.max_tokens",
                            d.prompt) if d.heldout_path else [])
    return contract, RMData(train, heldout, file_sha256(d.train_path))


def run(cfg, world: int) -> dict:
    import torch

    from megarl.config.loading import config_hash
    from megarl.reward_training.loop import RMRun, open_writer
    from megarl.roles.score_model import ScoreModel
    from megarl.runtime import distributed as rt

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(cfg.trainer.seed)
    contract, data = load_pairs(cfg)  # every pair is checked before the model loads
    p = cfg.parallel
    rt.initialize(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp, seed=cfg.trainer.seed,
                  first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers)
    run_dir = _run_dir(cfg)
    model = ScoreModel(cfg.model.path, cfg.optim, cfg.trainer.steps, contract.pad_token_id or 0, p.tp, p.pp,
                       cfg.model.vocab_multiple, sequence_parallel=p.sequence_parallel, recompute=p.recompute,
                       distributed_optimizer=p.distributed_optimizer, overlap_grad_reduce=p.overlap_grad_reduce,
                       center_coef=cfg.trainer.center_rewards_coef)
    hashes = {"config_hash": config_hash(cfg, exclude=("trainer.run_dir", "trainer.stop_after")),
              "train_sha256": data.train_sha256, "tokenizer_hash": contract.hash}
    rm = RMRun(cfg, model, data, contract, run_dir, hashes)
    last = rm.train(lambda resumed_at: open_writer(cfg, run_dir, rm.rank0, resumed_at))
    if "stopped_at" in last:
        rt.shutdown()
        return last
    out = rm.export()
    summary = {k: v for k, v in last.items() if k.startswith("eval/")}
    summary.update(export=out, steps=cfg.trainer.steps, init=model.init, train_pairs=len(data.train))
    if rm.rank0:
        with open(os.path.join(run_dir, "rm_summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(f"megarl.train_rm: exported {out}", flush=True)
    rt.shutdown()
    return summary


def _run_dir(cfg) -> str:
    """``trainer.run_dir`` (default runs/<recipe>-<time>), made, with the resolved config in it."""
    import time

    import torch.distributed as dist
    from omegaconf import OmegaConf

    path = cfg.trainer.run_dir or os.path.join("runs", f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}")
    if dist.is_initialized():
        box = [path]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
    if (not dist.is_initialized()) or dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    if dist.is_initialized():
        dist.barrier()
    return path


def ensure_builtin_pairs(cfg) -> None:
    """Write ``data.train_path`` / ``data.heldout_path`` with the built-in pairs when
    ``data.builtin`` names them and they are missing (rank 0 writes; the others wait).  A file
    already there must hold exactly these pairs, else it is refused naming the file."""
    import json

    from megarl.builtin.preference_pairs import arithmetic_pairs
    from megarl.commands.startup import _wait_for
    from megarl.data.tasks.arithmetic import write_jsonl

    d = cfg.data
    if d.builtin is None:
        return
    want = [(d.train_path, "train", d.builtin_train_n)]
    if d.heldout_path:
        want.append((d.heldout_path, "heldout", d.builtin_heldout_n))
    rank = int(os.environ.get("RANK", "0"))
    for path, split, n in want:
        if rank != 0:
            _wait_for(path, f"the built-in {split} preference pairs")
            continue
        rows = arithmetic_pairs(split, n)
        if os.path.exists(path):
            with open(path) as f:
                cached = [json.loads(line) for line in f if line.strip()]
            if cached != rows:
                raise MegarlError(f"data.builtin: {path} holds other pairs than data.builtin={d.builtin} with "
                                  f"{n} pairs writes; delete it to have it written again, or set data.builtin=null "
                                  "to use it as it is")
            continue
        write_jsonl(path, rows)
        print(f"wrote the built-in {split} preference pairs: {path} ({len(rows)} pairs)", flush=True)


def main_rm(config: Optional[str], overrides, print_only: bool = False) -> dict:
    from megarl.config.loading import load_config
    from megarl.config.rm_schema import RMTrainConfig

    cfg = load_config(config, list(overrides), schema=RMTrainConfig)
    if print_only:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
        return {"printed": True}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_rm_config(cfg, world)
    ensure_builtin_pairs(cfg)
    return run(cfg, world)

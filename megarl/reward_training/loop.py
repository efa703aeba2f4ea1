"""The reward-model trainer's loop (``python -m megarl.train_rm``): Bradley-Terry steps over
preference pairs, held-out pair accuracy, metrics, checkpoints with exact resume, and the HF
export ``reward.models`` reads.

The pair order is a function of (seed, step) only -- epoch ``e`` is a permutation seeded by
``seed + e``, and step ``k`` takes positions ``k*B .. (k+1)*B`` of the concatenated epochs -- so a
resumed run draws exactly the pairs the uninterrupted one would.  Each DP rank takes a contiguous
``B / dp`` of them; every step's rows are padded to the longest row of the whole global batch, so
the micro-batches do not depend on the layout either.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megarl.checkpointing import checkpoint
from megarl.errors import ConfigError

ROLE = "reward_model"
STATE_KEYS = ("config_hash", "train_sha256", "tokenizer_hash")


def pair_order(step: int, batch: int, n: int, seed: int) -> List[int]:
    """Indices of the ``batch`` pairs of global step ``step`` (of ``n`` pairs; module docstring)."""
    out, pos = [], step * batch
    perms: Dict[int, torch.Tensor] = {}
    for p in range(pos, pos + batch):
        epoch = p // n
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        out.append(int(perms[epoch][p % n]))
    return out


@dataclass
class RMData:
    train: List[tuple]  # (chosen ids, rejected ids) per pair
    heldout: List[tuple]
    train_sha256: str


def _reduced(metrics: List[dict]) -> Dict[str, float]:
    """The step's pair sums over DP (each pair counted once: the last pipeline stage's first TP
    and CP rank reports it)."""
    from megatron.core import parallel_state as ps

    keys = ("pairs", "correct", "margin_sum", "loss_sum")
    own = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
           and ps.get_context_parallel_rank() == 0)
    t = torch.tensor([sum(m[k] for m in metrics) if own else 0.0 for k in keys], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def heldout_accuracy(model, pairs: List[tuple], micro_batch_size: int) -> Dict[str, float]:
    """Held-out pair accuracy (``s_c > s_r``), mean margin and mean Bradley-Terry loss, and the sign
    accuracy: the share of held-out answers on the right side of 0 (chosen above, rejected below),
    which compares scores across prompts as a policy's reward does (collective)."""
    from megarl.algo.preference import bradley_terry_loss, pair_accuracy

    rows = [side for pair in pairs for side in pair]
    s = model.scores(rows, micro_batch_size)
    c, r = s[0::2], s[1::2]
    loss, m = bradley_terry_loss(c, r, normaliser=len(pairs))
    sign = float(((c > 0).float().sum() + (r < 0).float().sum()) / (2 * len(pairs)))
    return {"eval/pair_accuracy": pair_accuracy(c, r), "eval/sign_accuracy": sign,
            "eval/margin": m["margin_sum"] / len(pairs), "eval/loss": float(loss), "eval/pairs": float(len(pairs))}


class RMRun:
    """One reward-model run on this rank: the model, the data, the run directory."""

    def __init__(self, cfg, model, data: RMData, contract, run_dir: str, hashes: Dict[str, str]):
        from megatron.core import parallel_state as ps

        self.cfg, self.model, self.data, self.contract = cfg, model, data, contract
        self.run_dir, self.hashes = run_dir, hashes
        self.rank0 = (not dist.is_initialized()) or dist.get_rank() == 0
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.ckpt_root = os.path.join(run_dir, "checkpoints")
        t = cfg.trainer
        if t.pairs_per_step % self.dp:
            raise ConfigError(f"trainer.pairs_per_step: {t.pairs_per_step} pairs do not split over dp={self.dp} "
                              "data-parallel ranks (a multiple of dp expected)")
        if t.micro_batch_pairs and (t.pairs_per_step // self.dp) % t.micro_batch_pairs:
            raise ConfigError(f"trainer.micro_batch_pairs: {t.micro_batch_pairs} does not divide the "
                              f"{t.pairs_per_step // self.dp} pairs per DP rank (pairs_per_step / dp)")

    # ---- resume -------------------------------------------------------------------------------

    def resume(self) -> int:
        """The step to start at: 0, or the checkpoint's, with the model, optimizer, schedule and
        RNG restored; a checkpoint of other data, tokenizer or config is refused naming what changed."""
        latest = checkpoint.find_latest(self.ckpt_root)
        if latest is None:
            return 0
        if self.cfg.trainer.resume == "never":
            raise ConfigError(f"trainer.resume=never: {self.run_dir} holds a checkpoint ({latest}); pick another "
                              "trainer.run_dir or resume=auto")
        state = checkpoint.read_state(latest)
        changed = [k for k in STATE_KEYS if state.get(k) != self.hashes[k]]
        if changed:
            raise ConfigError(f"resume from {latest}: its {', '.join(changed)} differ from this run's; continue with "
                              "the same config and files, or start a new trainer.run_dir")
        checkpoint.load_roles(latest, {ROLE: (self.model.ddp, self.model.optimizer)})
        self.model.scheduler.load_state_dict(state["scheduler"])
        checkpoint.restore_rng(latest, same_layout=state.get("world") == (dist.get_world_size() if dist.is_initialized()
                                                                          else 1))
        if self.rank0:
            print(f"megarl.train_rm: resuming from {latest} at step {state['step']}", flush=True)
        return int(state["step"])

    def save(self, step: int) -> str:
        state = dict(self.hashes, step=step, scheduler=self.model.scheduler.state_dict(),
                     world=dist.get_world_size() if dist.is_initialized() else 1)
        return checkpoint.save(self.ckpt_root, step, state, {ROLE: (self.model.ddp, self.model.optimizer)},
                               keep=self.cfg.trainer.checkpoint_keep)

    # ---- the loop -----------------------------------------------------------------------------

    def step_batches(self, step: int) -> List[dict]:
        t = self.cfg.trainer
        idx = pair_order(step, t.pairs_per_step, len(self.data.train), t.seed)
        width = max(len(side) for i in idx for side in self.data.train[i])
        share = t.pairs_per_step // self.dp
        mine = [self.data.train[i] for i in idx[self.dp_rank * share:(self.dp_rank + 1) * share]]
        return self.model.micro_batches(mine, width, t.micro_batch_pairs)

    def evaluate(self) -> Dict[str, float]:
        if not self.data.heldout:
            return {}
        return heldout_accuracy(self.model, self.data.heldout, 2 * (self.cfg.trainer.micro_batch_pairs or 32))

    def train(self, open_writer) -> Dict[str, float]:
        """Steps from the last checkpoint (or 0) to ``trainer.steps``; ``open_writer(resumed_at)``
        gives the metrics writer.  Returns the last step's metrics."""
        start = self.resume()
        _truncate_metrics(self.run_dir, start, self.rank0)
        writer = open_writer(start or None)
        try:
            return self._steps(start, writer)
        finally:
            writer.close()

    def _steps(self, start: int, writer) -> Dict[str, float]:
        t = self.cfg.trainer
        last: Dict[str, float] = {}
        for step in range(start, t.steps):
            t0 = time.perf_counter()
            result = self.model.train_step(self.step_batches(step), t.pairs_per_step)
            s = _reduced(result.metrics)
            row = {"train/loss": s["loss_sum"] / max(s["pairs"], 1), "train/pair_accuracy": s["correct"] / max(s["pairs"], 1),
                   "train/margin": s["margin_sum"] / max(s["pairs"], 1), "train/grad_norm": result.grad_norm,
                   "train/lr": self.model.optimizer.param_groups[0]["lr"],
                   "train/update_skipped": float(not result.update_successful), "train/seconds": time.perf_counter() - t0}
            done = step + 1
            if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                row.update(self.evaluate())
            writer.write(done, row)
            last = row
            if self.rank0:
                acc = f" held-out acc {row['eval/pair_accuracy']:.3f}" if "eval/pair_accuracy" in row else ""
                print(f"step {done}/{t.steps} loss {row['train/loss']:.4f} train acc {row['train/pair_accuracy']:.3f}"
                      f"{acc}", flush=True)
            if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.steps:
                self.save(done)
            if t.stop_after is not None and done == t.stop_after and done < t.steps:
                if self.rank0:
                    print(f"megarl.train_rm: stopping after step {done} (trainer.stop_after); the run resumes from "
                          "its last checkpoint", flush=True)
                return dict(last, stopped_at=done)
        return last

    def export(self) -> str:
        """``<run_dir>/export``: the HF checkpoint with the tokenizer and chat template it read with,
        and the user-turn template of a reference-guided model (``data.prompt``)."""
        out = os.path.join(self.run_dir, "export")
        dtype = getattr(torch, self.cfg.trainer.export_dtype) if self.cfg.trainer.export_dtype else None
        self.model.export(out, tokenizer_dir=None, dtype=dtype)
        if self.rank0:
            tok = self.contract.tokenizer
            if self.contract.chat_template is not None:
                tok.chat_template = self.contract.chat_template
            tok.save_pretrained(out)
            from megarl.roles.reward_model import write_scorer_prompt

            write_scorer_prompt(out, self.cfg.data.prompt)
        if dist.is_initialized():
            dist.barrier()
        return out


def _truncate_metrics(run_dir: str, start: int, rank0: bool) -> None:
    """Rows of steps that will run again (written after the checkpoint) are dropped."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not rank0 or not os.path.isfile(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)["iteration"] <= start]
    with open(path + ".tmp", "w") as f:
        f.writelines(rows)
    os.replace(path + ".tmp", path)


def open_writer(cfg, run_dir: str, rank0: bool, resumed_at: Optional[int]):
    from megarl.observability.metrics import MetricsWriter

    trackers = []
    if rank0 and "tensorboard" in cfg.trainer.loggers:
        from megarl.observability.trackers import TensorBoardTracker

        trackers.append(TensorBoardTracker(run_dir, purge_step=resumed_at))
    return MetricsWriter(run_dir, rank0, trackers)

"""``python -m megarl.train --dry-run``: everything a start checks, and the plan, without training.

It validates the config at the world size (``--world-size N`` simulates one; default
``$WORLD_SIZE`` or 1), checks the run directory, builds the reward function, reads the model's
config.json and fits it to TP/PP, loads the tokenizer, loads and encodes the datasets (counting
rows), and prints the plan: the layout, the rollout's inference groups, the batch arithmetic and
a memory estimate per role.  It never initialises torch.distributed, never builds the built-in
tiny model or task files (it says it would), and writes nothing.

When the world size is simulated (the machine that will run it is not this one), an optional
package missing here (``rollout.backend=sglang``) is reported as "not checked here" instead of
failing; without ``--world-size`` it fails exactly as a real start would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

GiB = 1024 ** 3
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class ParamCount:
    """Parameters of a model from its config.json: the whole model and the heaviest (TP, PP)
    shard (the first / last pipeline stage carries the embedding / output layer)."""

    total: int
    per_shard: int
    dtype_bytes: int
    #: the routed-expert parameters of ``per_shard`` (mixture-of-experts models): the distributed
    #: optimizer shards their state over the expert data-parallel group, not the whole DP group
    per_shard_experts: int = 0


def _split_stages(per_layer: list, pp: int, stage_layers: tuple) -> list:
    """``per_layer`` cut into the pipeline stages' runs of layers (megarl/models/stages.py)."""
    from megarl.models.stages import stage_layer_counts

    out, start = [], 0
    for n in stage_layer_counts(len(per_layer), pp, *stage_layers):
        out.append(per_layer[start:start + n])
        start += n
    return out


def attention_params(spec) -> int:
    """One layer's attention parameters: grouped-query (q, k, v, o, their biases, q/k norms) or
    multi-latent (the q and kv down and up projections, their latent norms, o)."""
    h, d = spec.hidden_size, spec.head_dim
    mla = getattr(spec, "mla", None)
    if mla is not None:
        n = spec.num_attention_heads
        q = h * n * d if mla.q_lora_rank is None else (h + 1 + n * d) * mla.q_lora_rank
        kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank * (1 + n * (mla.qk_nope_head_dim
                                                                                       + mla.v_head_dim))
        return q + kv + n * mla.v_head_dim * h
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    return h * (q + 2 * kv) + q * h + ((q + 2 * kv) if spec.qkv_bias else 0) + (2 * d if spec.qk_norm else 0)


def count_params(spec, vocab_multiple: int, tp: int, pp: int, value_head: bool = False, ep: int = 1,
                 etp: Optional[int] = None, stage_layers: tuple = (None, None)) -> ParamCount:
    """Parameters of ``spec``: the whole model, and the heaviest shard (routed experts split over
    ``ep`` x ``etp``, everything else over ``tp``; the router is counted with the latter)."""
    h = spec.hidden_size
    attn = attention_params(spec)
    dense_mlp = 3 * h * spec.ffn_hidden_size  # SwiGLU: gate, up, down
    moe = getattr(spec, "moe", None)
    etp = tp if etp is None else etp
    # per layer: (parameters split over tp, routed-expert parameters split over ep x etp)
    per_layer = []
    for i in range(spec.num_layers):
        if moe is not None and moe.moe_layers[i]:
            shared = 3 * h * (moe.shared_expert_ffn_hidden_size or 0) + (h if moe.shared_expert_gate else 0)
            routed = moe.num_experts * 3 * h * moe.ffn_hidden_size
            router = moe.num_experts * (h + (1 if moe.router_expert_bias else 0))
            per_layer.append((attn + 2 * h + router + shared, routed))
        else:
            per_layer.append((attn + 2 * h + dense_mlp, 0))
    vocab = spec.padded_vocab_size(vocab_multiple)
    emb = vocab * h
    head = h + (1 if spec.value_head_bias else 0) if value_head else (0 if spec.tie_word_embeddings else vocab * h)
    total = sum(a + b for a, b in per_layer) + emb + head + h
    stages = [tuple(map(sum, zip(*part, strict=True))) for part in _split_stages(per_layer, pp, stage_layers)]
    a, b = max(stages, key=lambda ab: ab[0] / tp + ab[1] / (ep * etp))
    # pp > 1: the first stage holds the embedding, the last the output layer (a copy of the
    # embedding when tied)
    ends = emb + head if pp == 1 else max(emb, head if (head or value_head) else emb)
    per_shard = (a + ends) // tp + b // (ep * etp) + h
    name = str(spec.raw_config.get("dtype") or spec.raw_config.get("torch_dtype") or "bfloat16").replace("torch.", "")
    return ParamCount(total, per_shard, _DTYPE_BYTES.get(name, 2), b // (ep * etp))


def _lora_targets(spec) -> dict:
    """Each linear ``actor.lora`` can adapt: ``(fan_in, fan_out, TP split)``."""
    h = spec.hidden_size
    q, kv, f = spec.num_attention_heads * spec.head_dim, spec.num_query_groups * spec.head_dim, spec.ffn_hidden_size
    return {"linear_qkv": (h, q + 2 * kv, "column"), "linear_proj": (q, h, "row"),
            "linear_fc1": (h, 2 * f, "column"), "linear_fc2": (f, h, "row")}


def _lora_linears(spec, lora, i: int):
    """Each linear ``actor.lora`` adapts in layer ``i``: ``(fan_in, fan_out, TP split, routed)``.  A
    mixture-of-experts layer's fc1 / fc2 are each routed expert's (``routed``: split over the
    expert TP group, each on one EP rank) and the shared expert's (an ordinary TP linear)."""
    sizes, h = _lora_targets(spec), spec.hidden_size
    moe = getattr(spec, "moe", None)
    for name in lora.target_modules:
        if name not in sizes:
            continue
        fan_in, fan_out, style = sizes[name]
        if moe is None or not moe.moe_layers[i] or name in ("linear_qkv", "linear_proj"):
            yield fan_in, fan_out, style, False
            continue
        ffns = [(moe.ffn_hidden_size, True)] * moe.num_experts
        ffns += [(moe.shared_expert_ffn_hidden_size, False)] if moe.shared_expert_ffn_hidden_size else []
        for f, routed in ffns:
            yield (h, 2 * f, style, routed) if name == "linear_fc1" else (f, h, style, routed)


def lora_params(spec, lora, tp: int, pp: int, ep: int = 1, etp: Optional[int] = None,
                stage_layers: tuple = (None, None)) -> tuple:
    """``actor.lora``'s adapter parameters: ``(total, on the heaviest tp x pp (x ep) shard)``.  Per
    adapted linear r x (in + out); the column-parallel ones (qkv, fc1) split B over tp, the
    row-parallel ones (proj, fc2) split A; a routed expert's split over the expert TP group
    (``etp``, None: tp), its experts over ``ep``."""
    r, etp = lora.rank, tp if etp is None else etp
    per_layer = []
    for i in range(spec.num_layers):
        total = shard = 0.0
        for fan_in, fan_out, style, routed in _lora_linears(spec, lora, i):
            n, share = (etp, 1 / ep) if routed else (tp, 1)
            total += r * (fan_in + fan_out)
            shard += share * (r * fan_in + r * fan_out // n if style == "column" else r * fan_in // n + r * fan_out)
        per_layer.append((int(total), shard))
    return (sum(t for t, _ in per_layer),
            int(max(sum(s for _, s in part) for part in _split_stages(per_layer, pp, stage_layers))))


def lora_adapted_weights(spec, lora) -> int:
    """The parameters of the linears ``actor.lora`` adapts (their merged weights are what the
    weight sync sends after the first load)."""
    return sum(fan_in * fan_out for i in range(spec.num_layers)
               for fan_in, fan_out, _, _ in _lora_linears(spec, lora, i))


def role_memory(n: ParamCount, *, trains: bool, optimizer: str, dp: int,
                expert_dp: Optional[int] = None) -> Dict[str, float]:
    """GiB per GPU on CUDA: weights in the checkpoint's dtype; for a trained role fp32 gradients
    (megatron DDP, grad_reduce_in_fp32) and the distributed optimizer's state sharded over DP
    (fp32 main weights when the weights are 16-bit, plus Adam's two moments); a mixture-of-experts
    model's routed experts shard theirs over the expert data-parallel group (``expert_dp`` =
    world / (ep x etp x pp); None: ``dp``)."""
    out = {"weights": n.per_shard * n.dtype_bytes / GiB}
    if trains:
        out["grads"] = n.per_shard * 4 / GiB
        state = (4 if n.dtype_bytes < 4 else 0) + (8 if optimizer == "adam" else 0)
        experts = n.per_shard_experts
        out["optimizer"] = ((n.per_shard - experts) / dp + experts / (expert_dp or dp)) * state / GiB
    out["total"] = sum(out.values())
    return out


def batch_plan(cfg, dp: int) -> List[str]:
    t, r, a = cfg.trainer, cfg.rollout, cfg.algo
    samples = t.prompts_per_iteration * r.n
    mini = samples // a.num_mini_batches
    per_rank = mini // dp
    micro = a.micro_batch_size or per_rank
    fwd = a.forward_micro_batch_size or samples // dp
    steps = a.ppo_epochs * a.num_mini_batches
    lines = [f"batch: B={t.prompts_per_iteration} prompts x G={r.n} samples = {samples} samples per iteration",
             f"  {a.num_mini_batches} mini-batch(es) of {mini} samples "
             f"({t.prompts_per_iteration // a.num_mini_batches} prompts) -> {per_rank} per DP rank -> "
             f"{per_rank // micro} micro-batch(es) of {micro} "
             f"(algo.micro_batch_size={a.micro_batch_size})",
             f"  forward-only passes (old/ref log-probs, values): {-(-(samples // dp) // fwd)} per DP rank of "
             f"{fwd} rows (algo.forward_micro_batch_size={a.forward_micro_batch_size})",
             f"  optimizer steps: {a.ppo_epochs} epoch(s) x {a.num_mini_batches} mini-batch(es) = {steps} per "
             f"iteration, {steps * t.iterations} in total ({t.iterations} iterations)"]
    if cfg.critic is not None:
        cm = cfg.critic.micro_batch_size or per_rank
        lines.append(f"  critic: {per_rank // cm} micro-batch(es) of {cm} per DP rank; "
                     f"{cfg.critic.warmup_iters} critic-only warm-up iteration(s)")
    if a.dynamic_sampling.enabled:
        lines.append(f"  dynamic sampling: zero-spread groups dropped, up to {a.dynamic_sampling.max_rounds} "
                     "rounds of prompts per iteration")
    return lines


def _load_datasets(cfg, tok) -> List[str]:
    """The datasets loaded and encoded as the run loads them."""
    from megarl.data.prompts import configured_sources, load_configured_dataset
    from megarl.rewards.dataset_fields import drop_rows_missing_fields

    d = cfg.data
    out = []
    for key, path, split, subset in configured_sources(d):
        s = drop_rows_missing_fields(cfg, load_configured_dataset(d, tok, path, split=split, subset=subset)).stats
        missing = s.get("dropped_missing_fields", 0)
        out.append(f"ok   {key}: {path}: {s['kept']} of {s['rows']} rows kept ({s['dropped_overlong']} longer "
                   f"than data.max_prompt_tokens={d.max_prompt_tokens}; longest {s['max_prompt_tokens_seen']} tokens"
                   + (f"; {missing} without a field the reward reads, data.on_missing_fields=skip" if missing else "")
                   + ")")
    return out


def _gib(x: float) -> str:
    return f"{x:.1f} GiB" if x >= 1 else f"{x * 1024:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _memory_lines(cfg, spec, dp: int) -> List[str]:
    from megarl.models.hf_config import load_spec

    p = cfg.parallel
    split = (p.first_stage_layers, p.last_stage_layers)
    actor = count_params(spec, cfg.model.vocab_multiple, p.tp, p.pp, ep=p.ep, etp=p.etp, stage_layers=split)
    lines = [f"memory per GPU (CUDA; from config.json: {_count(actor.total)} parameters, "
             f"{_count(actor.per_shard)} on the heaviest tp x pp shard, {actor.dtype_bytes}-byte weights):"]

    def show(role: str, mem: Dict[str, float], note: str = "") -> None:
        parts = " + ".join(f"{k} {_gib(v)}" for k, v in mem.items() if k != "total")
        lines.append(f"  {role:<13}{parts} = {_gib(mem['total'])}{note}")

    expert_dp = dp * p.tp // (p.ep * (p.tp if p.etp is None else p.etp))  # world / (ep x etp x pp)
    lo = cfg.actor.lora
    if lo.rank:  # the base frozen: gradients and optimizer state for the adapters only
        total, shard = lora_params(spec, lo, p.tp, p.pp, ep=p.ep, etp=p.etp, stage_layers=split)
        adapters = ParamCount(total, shard, actor.dtype_bytes)
        mem = role_memory(adapters, trains=True, optimizer=cfg.actor.optim.optimizer, dp=dp)
        mem = {"weights": actor.per_shard * actor.dtype_bytes / GiB + mem["weights"],
               "grads": mem["grads"], "optimizer": mem["optimizer"]}
        mem["total"] = sum(mem.values())
        full = role_memory(actor, trains=True, optimizer=cfg.actor.optim.optimizer, dp=dp, expert_dp=expert_dp)
        lines.append(f"  actor.lora   rank {lo.rank} on {', '.join(lo.target_modules)}: {_count(total)} trainable "
                     f"parameters ({100 * total / actor.total:.2f}% of the model), {_count(shard)} on the heaviest "
                     f"shard; gradients + optimizer {_gib(mem['grads'] + mem['optimizer'])} per GPU against "
                     f"{_gib(full['grads'] + full['optimizer'])} fully fine-tuned")
        show("actor", mem, " (on the host while the rollout generates: actor.offload)" if cfg.actor.offload else "")
        whole, adapted = actor.total * actor.dtype_bytes, lora_adapted_weights(spec, lo) * actor.dtype_bytes
        after = (f"then {_gib(adapted / GiB)} (the adapted linears, merged; the engine keeps the rest)"
                 if cfg.rollout.backend == "hf" and cfg.placement.mode == "hybrid"
                 else f"then {_gib(whole / GiB)} again (rollout.backend={cfg.rollout.backend}: every tensor each time)")
        lines.append(f"  weight sync  {_gib(whole / GiB)} per engine the first time, {after}")
    else:
        show("actor", role_memory(actor, trains=True, optimizer=cfg.actor.optim.optimizer, dp=dp, expert_dp=expert_dp),
             " (on the host while the rollout generates: actor.offload)" if cfg.actor.offload else "")
    if cfg.reference.enabled and lo.rank and cfg.reference.path is None:
        lines.append(f"  {'reference':<13}the actor with its adapters off: no memory of its own")
    elif cfg.reference.enabled:
        ref = actor if cfg.reference.path is None else count_params(load_spec(cfg.reference.path),
                                                                    cfg.model.vocab_multiple, p.tp, p.pp,
                                                                    ep=p.ep, etp=p.etp)
        show("reference", role_memory(ref, trains=False, optimizer="", dp=dp),
             " (on the host between its forwards)" if cfg.reference.offload else "")
    if cfg.teacher.path and os.path.isfile(os.path.join(cfg.teacher.path, "config.json")):
        served = cfg.teacher.engine in ("hf", "sglang")  # the whole model in an engine on rank 0
        teacher = count_params(load_spec(cfg.teacher.path), cfg.model.vocab_multiple, *((1, 1) if served else (p.tp, p.pp)),
                               ep=1 if served else p.ep, etp=None if served else p.etp)
        show("teacher", role_memory(teacher, trains=False, optimizer="", dp=dp),
             (f" (the {cfg.teacher.engine} engine, rank 0 only"
              + (f", mem_fraction_static {cfg.teacher.mem_fraction_static}" if cfg.teacher.engine == "sglang" else "")
              + ")" if served else "")
             + (" (on the host between its forwards)" if cfg.teacher.offload else ""))
    elif cfg.teacher.path:
        lines.append(f"  {'teacher':<13}teacher.path {cfg.teacher.path} has no config.json yet: not counted")
    if cfg.critic is not None:
        cspec = spec if cfg.critic.path is None else load_spec(cfg.critic.path)
        crit = count_params(cspec, cfg.model.vocab_multiple, p.tp, p.pp, value_head=True, stage_layers=split)
        show("critic", role_memory(crit, trains=True, optimizer=cfg.critic.optim.optimizer, dp=dp),
             " (on the host while the rollout generates)" if cfg.critic.offload else "")
    if cfg.reward.model.path:
        rm = count_params(load_spec(cfg.reward.model.path), cfg.model.vocab_multiple, p.tp, p.pp, value_head=True,
                          stage_layers=split)
        show("reward model", role_memory(rm, trains=False, optimizer="", dp=dp),
             " (on the host between its forwards)" if cfg.reward.model.offload else "")
    r = cfg.rollout
    if r.backend == "sglang":
        lines.append(f"  {'rollout':<13}rollout.mem_fraction_static={r.mem_fraction_static} of each GPU (weights "
                     f"{_gib(actor.total * actor.dtype_bytes / r.tp / GiB)} per rollout.tp={r.tp} shard + KV cache)")
    else:
        lines.append(f"  {'rollout':<13}hf engine: a full copy of the weights on each DP replica's leader "
                     f"({_gib(actor.total * 4 / GiB)} in fp32)")
    from megarl.commands.activation_memory import activation_lines

    return lines + activation_lines(cfg, spec, dp)


def _run_dir_line(cfg) -> str:
    """What a start would do with ``trainer.run_dir``: resume, start over, or start a new run."""
    from megarl.checkpointing.run_dir import inspect_run_dir, start_decision

    run_dir = cfg.trainer.run_dir
    if not run_dir:
        return "ok   trainer.run_dir: runs/ is writable (default: runs/<recipe>-<timestamp>)"
    state = inspect_run_dir(run_dir)
    finished = start_decision(cfg, state, dry=True)
    if finished:
        what = finished
    elif state.checkpoint and cfg.trainer.resume == "auto":
        what = f"would resume from {state.checkpoint}"
    else:
        what = "would move the interrupted attempt aside and start over" if state.used else "would start a new run"
    return f"ok   trainer.run_dir: {run_dir}: {what}"


def _check_model_and_data(cfg, lines: list):
    """Check the model (its fit on the layout), the tokenizer and the datasets as a start would,
    a line for each onto ``lines``; returns the model's spec."""
    from megarl.commands.startup import check_model
    from megarl.data.tokenizer import TokenizerContract
    from megarl.models.fit import validate_model_fit
    from megarl.models.hf_config import load_spec
    from megarl.rewards.dataset_fields import check_datasets_against_reward

    check_datasets_against_reward(cfg)
    check_model(cfg)  # also resolves Hub ids to their local snapshots, as a start does
    spec = load_spec(cfg.model.path)
    validate_model_fit(cfg, spec, where=os.path.join(cfg.model.path, "config.json"))
    p = cfg.parallel
    moe = getattr(spec, "moe", None)
    experts = (f", {moe.num_experts} experts (top-{moe.top_k}) over ep {p.ep} x etp {p.etp or p.tp}"
               if moe is not None else "")
    lines.append(f"ok   model.path: {cfg.model.path}: {spec.architecture}, {spec.num_layers} layers, hidden "
                 f"{spec.hidden_size}, {spec.num_attention_heads} heads / {spec.num_query_groups} KV heads: "
                 f"fits tp {p.tp} x pp {p.pp}{experts}")
    tok_dir = cfg.model.tokenizer or cfg.model.path
    tok = TokenizerContract.load(tok_dir, cfg.model.chat_template)
    lines.append(f"ok   tokenizer: {tok_dir}: loads (contract {tok.hash[:12]})")
    lines += _load_datasets(cfg, tok)
    return spec


def _placement_lines(cfg, world: int, dp: int) -> list:
    """The plan's lines on ranks, rollout placement and partial rollouts."""
    p, r = cfg.parallel, cfg.rollout
    lines = []
    split = cfg.placement.mode == "split"
    trainers = world - cfg.placement.rollout_ranks if split else world
    cp_part = f" x cp {p.cp}" if p.cp > 1 else ""
    lines.append(f"plan: {'trainer ranks' if split else 'world'} {trainers} = tp {p.tp} x pp {p.pp}{cp_part} x dp {dp}"
                 f"{f' (pp with {p.vpp} virtual stages each: interleaved 1F1B)' if p.vpp > 1 else ''} (actor, "
                 f"reference{', critic' if cfg.critic is not None else ''}{', teacher' if cfg.teacher.path else ''}"
                 f"{', reward model' if cfg.reward.model.path else ''})")
    if split:
        an = cfg.async_rl
        mode = (f"asynchronous: generation runs up to async_rl.max_staleness={an.max_staleness} optimizer step(s) "
                f"ahead, every trained token at most that old; correction {an.correction}; proximal log-probs "
                f"from the {'rollout engine, teacher-forced' if an.proximal_log_probs == 'engine' else 'actor'}"
                if an.max_staleness else "synchronous (async_rl.max_staleness=0)")
        lines.append(f"rollout: {r.backend}, placement split: the last {cfg.placement.rollout_ranks} rank(s) of "
                     f"{world} only generate, one engine each; {mode}; a lost side is named within "
                     f"placement.timeout_s={cfg.placement.timeout_s:g}s")
    elif r.backend == "sglang":
        lines.append(f"rollout: sglang, {world // r.tp} inference group(s) of rollout.tp={r.tp} GPUs")
    else:
        lines.append(f"rollout: hf, {dp} engine(s), one per data-parallel replica")
    if cfg.async_rl.partial_rollouts:
        an, B = cfg.async_rl, cfg.trainer.prompts_per_iteration
        carry = (f"unfinished candidates carry over with their tokens, each group trained within "
                 f"async_rl.max_staleness={an.max_staleness} step(s) of its admission; correction {an.correction}"
                 if an.max_staleness else "unfinished groups start again next iteration, where they are due "
                 "(async_rl.max_staleness=0: every trained token on-policy)")
        lines.append(f"partial rollouts: {B} + {an.extra_groups} groups open, generated async_rl.segment_tokens="
                     f"{an.segment_tokens} tokens at a time until {B} are complete; {carry}")
    return lines


def dry_run(cfg, world_size: Optional[int] = None) -> dict:
    """Check and plan; print one line per check; return the plan (for tests)."""
    from megarl.builtin.warmstart import is_built
    from megarl.commands.run_checks import check_run
    from megarl.commands.startup import check_reward
    from megarl.config import missing_packages
    from megarl.commands.startup import check_start_paths

    simulated = world_size is not None
    world = world_size if simulated else int(os.environ.get("WORLD_SIZE", "1"))
    dp = check_run(cfg, world)
    lines = [f"ok   config: recipe {cfg.recipe}, {cfg.algo.name} ({cfg.algo.advantage}), valid at world size {world}"
             + (" (simulated: --world-size)" if simulated else "")]
    not_checked = []
    for key, msg in missing_packages(cfg):
        if not simulated:
            from megarl.errors import ConfigError

            raise ConfigError(f"{key}: {msg}")
        not_checked.append(f"{key}: {msg.split(';')[0]}")
    check_start_paths(cfg)
    lines.append(_run_dir_line(cfg))
    check_reward(cfg)
    if cfg.rollout.agent.env:  # validated with its arguments above (check_environment)
        ag = cfg.rollout.agent
        lines.append(f"ok   rollout.agent: environment {ag.env} loads; it scores each episode "
                     f"(at most {ag.max_turns} turns, {ag.max_total_tokens} tokens)")
    else:
        lines.append(f"ok   reward: {cfg.reward.fn or 'reward model only'} builds"
                     + (f" (+ reward model {cfg.reward.model.path})" if cfg.reward.model.path else ""))

    builds = []
    if cfg.model.build_tiny and not is_built(cfg.model.path):
        builds.append(f"would build the built-in tiny model at model.path={cfg.model.path} (model.tiny.*, on data.task.name={cfg.data.task.name})")
    if cfg.data.task.name is not None and cfg.data.task.build:
        task = cfg.data.task.name
        paths = (("data.train_path", cfg.data.train_path), ("data.heldout_path", cfg.data.heldout_path))
        builds += [f"would build the {task} task file {key}={path}" for key, path in paths
                   if path and not os.path.exists(path)]
    spec = None
    if not builds:
        spec = _check_model_and_data(cfg, lines)
    else:
        lines += [f"--   {b}" for b in builds]
        lines.append("--   model, tokenizer and datasets: checked once built (a real start builds them first)")

    lines.append("")
    lines += _placement_lines(cfg, world, dp)
    lines += batch_plan(cfg, dp)
    if spec is not None:
        lines += _memory_lines(cfg, spec, dp)
    else:
        lines.append("memory: not estimated (the model's config.json does not exist yet)")
    for item in not_checked:
        lines.append(f"not checked here: {item}")
    lines.append("dry run: nothing was trained or written")
    print("\n".join(lines), flush=True)
    return {"dry_run": True, "world": world, "dp": dp, "lines": lines, "not_checked": not_checked,
            "would_build": builds}

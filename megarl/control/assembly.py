"""Assembly: the run config -> the objects the phase components work on.

This is the one place that reads most of the config to build things: the tokenizer contract,
the prompt datasets and their sampler, the roles (actor, reference, critic, reward model), the
reward function and its runner, the KL controller, the fault plan, and the rollout engines.
Construction order is part of the run's reproducibility (model initialisation and the engine's
construction draw from torch's RNG; a resume restores the RNG between the roles and the
engine), so the driver calls :func:`assemble` first and :func:`assemble_engine` after resume.
:func:`wire_components` then builds the phase components over those parts: this module and the
driver are the only ones that import the components.
"""

from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from megarl.algo.kl import AdaptiveKLController, FixedKLController
from megarl.algo.registry import advantage_needs
from megarl.config.schema import TrainConfig
from megarl.control.heldout import Evaluator
from megarl.control.interfaces import RunProgress
from megarl.control.learning import Learner
from megarl.control.placement import Placement, create_engine, create_remote_engine, make_placement
from megarl.control.preparation import ExperiencePreparer, LogProbParity
from megarl.control.production import GroupRolloutProducer
from megarl.control.production_agent import AgentEpisodeMetrics
from megarl.control.production_ahead import AheadAdmission
from megarl.control.production_partial import PartialRolloutProducer
from megarl.control.publication import EngineTimeSlice, WeightPublisher
from megarl.control.scoring import EpisodeScorer, Scorer
from megarl.control.state_machine import IterationStateMachine
from megarl.data.demonstrations import Demonstrations, load_demonstrations
from megarl.data.prompts import PromptDataset, PromptSampler, load_configured_dataset
from megarl.data.tokenizer import TokenizerContract
from megarl.envs.protocol import load_environment
from megarl.envs.render import EnvTurnRenderer, check_template
from megarl.models.safetensors_io import model_dir_eos_token_ids
from megarl.rewards import build_reward_function
from megarl.rewards.base import RewardFunction
from megarl.rewards.dataset_fields import drop_rows_missing_fields
from megarl.rewards.declarations import component_checks
from megarl.rewards.faulty import FaultyRewardFunction
from megarl.rewards.isolation import resolve_isolation
from megarl.rewards.runner import RewardRunner
from megarl.roles.actor import Actor
from megarl.roles.adapter_reference import AdapterOffReference
from megarl.roles.critic import Critic
from megarl.roles.faulty_actor import FaultyActor
from megarl.roles.faulty_reward_model import FaultyRewardModel
from megarl.roles.reference import Reference
from megarl.roles.teacher import Teacher, check_teacher_tokenizer
from megarl.roles.reward_model import RewardModel
from megarl.rollout.agent import AgentLimits, AgentSessionEngine
from megarl.rollout.faulty import FaultyRolloutEngine
from megarl.rollout.protocol import RolloutEngine
from megarl.rollout.remote import RolloutService
from megarl.runtime.data_parallel import broadcast_object
from megarl.runtime.distributed import device
from megarl.runtime.faults import FaultInjector
from megarl.runtime.split import split_world



@dataclass
class Parts:
    """Everything built before a resume (see the module docstring)."""

    tok: TokenizerContract
    train_data: PromptDataset
    heldout: Optional[PromptDataset]  # None without data.heldout_path
    sampler: PromptSampler
    actor: Actor
    reference: Optional[Union[Reference, AdapterOffReference]]  # None unless reference.enabled
    critic: Optional[Critic]  # None without a critic section
    injector: Optional[FaultInjector]  # a FaultInjector when any faults.* key is set, else None
    reward_fn: Optional[RewardFunction]  # None when the environment scores (reward.fn null)
    reward_runner: Optional[RewardRunner]  # rank 0 only
    reward_models: Tuple[Union[RewardModel, FaultyRewardModel], ...]  # reward.model, then reward.models
    kl_ctl: Union[FixedKLController, AdaptiveKLController]
    #: rank 0's runner of eval.grader, the held-out evaluation's rule (None: it grades with the training reward)
    grader_runner: Optional[RewardRunner] = None
    judges: tuple = ()  # reward.judges: each GenerativeJudge on rank 0, None elsewhere
    teacher: Optional[Teacher] = None  # teacher.path: on-policy distillation's teacher
    demonstrations: Optional[Demonstrations] = None  # algo.sft: the SFT term's rows and cursor


@dataclass
class Components:
    """The phase components of one run, wired to the parts and to each other's interfaces."""

    publisher: WeightPublisher
    producer: GroupRolloutProducer  # or its PartialRolloutProducer (async_rl.partial_rollouts)
    preparer: ExperiencePreparer
    learner: Learner
    evaluator: Evaluator


@dataclass
class EngineParts:
    placement: Placement
    engine: Optional[RolloutEngine]  # None on ranks that hold no engine
    pad_id: int
    sync_dtype: Optional[torch.dtype]
    stop_token_ids: tuple = ()  # what every engine ends a response on (eos_and_pad), for the record


def assemble(cfg: TrainConfig, model_path: str, tokenizer_dir: str) -> Parts:
    tok = TokenizerContract.load(tokenizer_dir, cfg.model.chat_template)
    d = cfg.data
    train_data = load_configured_dataset(d, tok, d.train_path, split=d.train_split, subset=d.train_subset)
    heldout = (load_configured_dataset(d, tok, d.heldout_path, split=d.heldout_split, subset=d.heldout_subset)
               if d.heldout_path else None)
    # data.on_missing_fields=skip
    train_data, heldout = drop_rows_missing_fields(cfg, train_data), drop_rows_missing_fields(cfg, heldout)
    sampler = PromptSampler(len(train_data), seed=cfg.trainer.seed, shuffle=d.shuffle)
    demonstrations = load_demonstrations(cfg, tok) if cfg.algo.sft.path else None  # before any model loads

    p, a = cfg.parallel, cfg.algo
    total_steps = cfg.trainer.iterations * a.ppo_epochs * a.num_mini_batches
    actor = Actor(model_path, p.tp, p.pp, cfg.actor.optim, total_steps, vocab_multiple=cfg.model.vocab_multiple,
                  offload=cfg.actor.offload, moe_aux_loss_coeff=cfg.actor.moe_aux_loss_coeff,
                  moe_z_loss_coeff=cfg.actor.moe_z_loss_coeff, sequence_parallel=p.sequence_parallel,
                  overlap_grad_reduce=p.overlap_grad_reduce, recompute=p.recompute, log_prob_chunk=a.log_prob_chunk,
                  distributed_optimizer=p.distributed_optimizer, lora=cfg.actor.lora, seed=cfg.trainer.seed)
    reference = None
    if cfg.reference.enabled and cfg.actor.lora.rank and cfg.reference.path is None:
        reference = AdapterOffReference(actor)  # the LoRA actor's base: no second copy
    elif cfg.reference.enabled:
        reference = Reference(cfg.reference.path or model_path, p.tp, p.pp, version="ref-0",
                              vocab_multiple=cfg.model.vocab_multiple, offload=cfg.reference.offload,
                              sequence_parallel=p.sequence_parallel, log_prob_chunk=a.log_prob_chunk)
    teacher = None
    if cfg.teacher.path:
        check_teacher_tokenizer(cfg.teacher.path, tok.hash, cfg.model.chat_template)
        teacher = make_teacher(cfg, tok)
    critic = None
    if cfg.critic is not None:
        critic = Critic(cfg.critic, actor.model, p.tp, p.pp, total_steps, vocab_multiple=cfg.model.vocab_multiple,
                        sequence_parallel=p.sequence_parallel, overlap_grad_reduce=p.overlap_grad_reduce,
                        recompute=p.recompute, distributed_optimizer=p.distributed_optimizer, seed=cfg.trainer.seed)
    injector = FaultInjector(cfg.faults, seed=cfg.faults.seed, rank=dist.get_rank(), world=dist.get_world_size())
    injector = injector if injector.active else None
    reward_fn, runner, reward_models = _rewards(cfg, injector, rank0=dist.get_rank() == 0)
    judges = make_judges(cfg, rank0=dist.get_rank() == 0)
    kl_ctl = (AdaptiveKLController(a.kl.beta, a.kl.target, a.kl.horizon) if a.kl.adaptive
              else FixedKLController(a.kl.beta))
    return Parts(tok=tok, train_data=train_data, heldout=heldout, sampler=sampler, actor=actor, reference=reference,
                 critic=critic, injector=injector, reward_fn=reward_fn, reward_runner=runner,
                 reward_models=reward_models, kl_ctl=kl_ctl, judges=judges, demonstrations=demonstrations,
                 grader_runner=grader_runner(cfg, dist.get_rank() == 0), teacher=teacher)


def _rewards(cfg: TrainConfig, injector: Optional[FaultInjector], rank0: bool):
    r = cfg.reward
    fn = build_reward_function(r.fn, r.kwargs, r.components) if r.fn else None
    if fn is not None and cfg.faults.reward_timeout_rate:
        # an injected hang lasts ten timeouts: it is still hanging when the runner's timeout is
        # declared however late a busy machine wakes the runner, so the count stays exact
        fn = FaultyRewardFunction(fn, injector, hang_s=10.0 * r.timeout_s)
    runner = None
    if fn and rank0:
        # faults.reward_timeout_rate wraps fn here, in the trainer: those runs stay on threads
        runner = _runner(r, fn, "thread" if cfg.faults.reward_timeout_rate else None)
    reward_models = []
    p = cfg.parallel
    for key, m in r.neural_models():  # each its own frozen role: its own tokenizer, template, offload
        rm = RewardModel(m.path, p.tp, p.pp, tokenizer=m.tokenizer, chat_template=m.chat_template,
                         vocab_multiple=cfg.model.vocab_multiple, offload=m.offload,
                         micro_batch_size=cfg.algo.forward_micro_batch_size, pack=cfg.algo.pack_sequences,
                         micro_batch_tokens=cfg.algo.micro_batch_tokens, sequence_parallel=p.sequence_parallel,
                         key=key, prompt=m.prompt)
        if injector is not None and (cfg.faults.reward_model_error_at or cfg.faults.reward_model_timeout_at):
            rm = FaultyRewardModel(rm, injector, m.timeout_s)
        reward_models.append(rm)
    return fn, runner, tuple(reward_models)


def _lora_sync_names(cfg: TrainConfig, actor):
    """A LoRA actor on the in-process hf engine: the tensors its updates change, the only ones sent
    after the first load (the hf engine keeps the rest, proven against the manifest:
    KeepsUnsentTensors).  None (every tensor, each time) otherwise."""
    if not actor.adapters or cfg.rollout.backend != "hf" or cfg.placement.mode != "hybrid":
        return None
    from megarl.models.lora import adapted_hf_names

    return adapted_hf_names(actor.ddp)


def _engine_adapter(cfg: TrainConfig):
    """``actor.lora.engine: adapter``: what the publisher tells SGLang's LoRA backend about the
    adapter (None: the engine is sent merged weights)."""
    lo = cfg.actor.lora
    if not lo.rank or lo.engine != "adapter":
        return None
    return {"rank": lo.rank, "alpha": lo.alpha, "base_model": str(cfg.model.path)}


def make_teacher(cfg: TrainConfig, tok):
    """``teacher``: a frozen megatron model at the actor's TP/PP, or (``teacher.engine: hf | sglang``)
    the checkpoint served by an engine of its own on rank 0."""
    p, t = cfg.parallel, cfg.teacher
    if t.engine in ("hf", "sglang"):
        from megarl.roles.served_teacher import ServedTeacher

        return ServedTeacher(t.path, tok, str(device()), rank0=dist.get_rank() == 0, offload=t.offload,
                             backend=t.engine, mem_fraction_static=t.mem_fraction_static)
    return Teacher(t.path, p.tp, p.pp, vocab_multiple=cfg.model.vocab_multiple, offload=t.offload,
                   sequence_parallel=p.sequence_parallel, log_prob_chunk=cfg.algo.log_prob_chunk)


def make_judges(cfg: TrainConfig, rank0: bool) -> tuple:
    """``reward.judges``: each a GenerativeJudge on rank 0 (where the rule runner runs; its
    verdicts are broadcast), None on the other ranks."""
    if not rank0:
        return tuple(None for _ in cfg.reward.judges)
    from megarl.roles.judge import GenerativeJudge

    return tuple(GenerativeJudge(j, f"reward.judges[{i}]", str(device())) for i, j in enumerate(cfg.reward.judges))


def _runner(r, fn, isolation: Optional[str] = None) -> RewardRunner:
    """The rank-0 runner of the reward section ``r``'s rule function ``fn``."""
    isolation = isolation or resolve_isolation(r.isolation, r.fn, r.components)
    spec = {"fn": r.fn, "kwargs": dict(r.kwargs or {}), "components": list(r.components or [])}
    return RewardRunner(fn, timeout_s=r.timeout_s, max_retries=r.max_retries, backoff_s=r.retry_backoff_s,
                        max_workers=r.workers, isolation=isolation, spec=spec, kill_grace_s=r.kill_grace_s,
                        max_memory_mb=r.max_memory_mb, cpu_time_s=r.cpu_time_s)


def grading_reward(cfg: TrainConfig):
    """``eval.grader`` as a reward section: that rule alone (no reward model, no judge, no
    composite, no shaping), with the training reward's timeouts, isolation and penalties; None when unset."""
    from megarl.config.schema import RewardModelConfig

    if cfg.eval.grader is None:
        return None
    return dataclasses.replace(cfg.reward, fn=cfg.eval.grader, kwargs=dict(cfg.eval.grader_kwargs), components=[],
                               model=RewardModelConfig(), models=[], judges=[], overlong_buffer=None)


def grader_scorer(cfg: TrainConfig, tok: TokenizerContract, runner: Optional[RewardRunner], counters,
                  quarantine_path: str, rank0: bool) -> Scorer:
    """The held-out evaluation's scorer under ``eval.grader`` (``runner``: rank 0's,
    :func:`grader_runner`)."""
    return Scorer(grading_reward(cfg), tok, runner, (), counters, quarantine_path, rank0,
                  max_new_tokens=cfg.rollout.max_new_tokens, shape_overlong=False)


def grader_runner(cfg: TrainConfig, rank0: bool) -> Optional[RewardRunner]:
    """Rank 0's runner of ``eval.grader`` (None elsewhere, or when unset)."""
    r = grading_reward(cfg)
    return _runner(r, build_reward_function(r.fn, r.kwargs, r.components)) if r is not None and rank0 else None


def make_scorer(cfg: TrainConfig, tok: TokenizerContract, runner: Optional[RewardRunner], reward_models, counters,
                quarantine_path: str, rank0: bool, *, shape_overlong: bool, judges=None) -> Scorer:
    """The run's sample scorer (training: with ``reward.overlong_buffer`` shaping; evaluation,
    here and in ``python -m megarl.eval``: without); ``judges``: :func:`make_judges`'s."""
    return Scorer(cfg.reward, tok, runner, reward_models, counters, quarantine_path, rank0,
                  max_new_tokens=cfg.rollout.max_new_tokens, shape_overlong=shape_overlong,
                  judges=judges if judges is not None else make_judges(cfg, rank0))


def episode_scorer(cfg: TrainConfig, tok: TokenizerContract, counters, quarantine_path: str,
                   rank0: bool) -> EpisodeScorer:
    """The scorer of agent trajectories: the environment's reward components."""
    return EpisodeScorer(cfg.reward, tok, counters, quarantine_path, rank0, env_name=cfg.rollout.agent.env)


def agent_engine(cfg: TrainConfig, tok: TokenizerContract, engine: Optional[RolloutEngine]):
    """``rollout.agent``: the engine wrapped so that each candidate is a multi-turn session
    against a fresh environment (:class:`megarl.rollout.agent.AgentSessionEngine`), and the
    chat-template report of the start-up check (:func:`megarl.envs.render.check_template`).
    ``engine`` None (a rank that holds none) stays None."""
    ag = cfg.rollout.agent
    report = check_template(tok)
    if engine is None:
        return None, report
    renderer = EnvTurnRenderer(tok)
    return AgentSessionEngine(engine, env_factory=load_environment(ag.env, **ag.env_args), renderer=renderer,
                              limits=AgentLimits(max_turns=ag.max_turns, max_total_tokens=ag.max_total_tokens),
                              decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                              step_timeout_s=ag.step_timeout_s, max_workers=ag.max_workers,
                              encode_prompt=tok.encode_prompt), report


def evaluation_scorer(cfg: TrainConfig, tok: TokenizerContract, counters, quarantine_path: str):
    """``(scorer, runner, reward function)`` for an evaluation outside a training run (one
    process): the configured reward under its runner, scored like the held-out evaluation (an
    agent's episodes by their environment: no runner, no function).  Close the runner after use."""
    if cfg.rollout.agent.env:
        return episode_scorer(cfg, tok, counters, quarantine_path, True), None, None
    if cfg.eval.grader is not None:  # the rule, not the training reward
        runner = grader_runner(cfg, True)
        return grader_scorer(cfg, tok, runner, counters, quarantine_path, True), runner, runner.fn
    fn, runner, reward_models = _rewards(cfg, None, rank0=True)
    scorer = make_scorer(cfg, tok, runner, reward_models, counters, quarantine_path, True, shape_overlong=False)
    return scorer, runner, fn


def eos_and_pad(tok: TokenizerContract, config_dir: str):
    """The ids that end a response -- the contract's eos and the model dir's (config.json /
    generation_config.json), which SGLang stops on regardless, so both backends end responses on
    the same tokens -- and the padding id."""
    eos = list(dict.fromkeys(([tok.eos_token_id] if tok.eos_token_id is not None else [])
                             + list(model_dir_eos_token_ids(config_dir))))
    return eos, (tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0))


def assemble_engine(cfg: TrainConfig, tok: TokenizerContract, config_dir: str,
                    injector: Optional[FaultInjector]) -> EngineParts:
    """The rollout engines, created on an HF config of the actor (``config_dir``; weights only
    ever arrive by stream), and the dtype weights are synced in."""
    split = split_world() if cfg.placement.mode == "split" else None
    placement = make_placement(cfg.rollout.backend, cfg.rollout.tp, split=split is not None)
    eos, pad = eos_and_pad(tok, config_dir)
    engine = (create_remote_engine(split, config_dir, eos, pad) if split is not None
              else create_engine(cfg, placement, config_dir, eos, pad))
    if engine is not None and (cfg.faults.rollout_error_rate or cfg.faults.duplicate_result_rate):
        engine = FaultyRolloutEngine(engine, injector)
    sync_dtype = broadcast_object(engine.dtype if engine is not None and dist.get_rank() == 0 else None)
    if isinstance(sync_dtype, str):
        sync_dtype = getattr(torch, sync_dtype)
    return EngineParts(placement=placement, engine=engine, pad_id=pad, sync_dtype=sync_dtype,
                       stop_token_ids=tuple(eos))


def serve_rollout_rank(cfg: TrainConfig, world) -> dict:
    """A rollout rank's whole job in split placement: build the engine the trainer names and
    execute its commands until it says stop.  With ``rollout.agent.env`` the sessions run here,
    next to the engine: each generate command answers whole trajectories."""
    def make_engine(config_dir, eos, pad):
        return create_engine(cfg, Placement(num_groups=1, group_index=0, is_group_leader=True), config_dir, eos, pad)

    def agent_generator(engine):
        return agent_engine(cfg, tok, engine)[0]

    make_generator = None
    if cfg.rollout.agent.env:  # the sessions run next to the engine
        tok = TokenizerContract.load(cfg.model.tokenizer or cfg.model.path, cfg.model.chat_template)
        make_generator = agent_generator

    return RolloutService(world, make_engine, device=device(), kill_at_load=cfg.faults.kill_rollout_at_load,
                          segment_tokens=cfg.async_rl.segment_tokens, segment_delay_s=cfg.faults.rollout_segment_delay_s,
                          segment_await_s=cfg.faults.rollout_segment_await_s,
                          make_generator=make_generator).serve()


def _rollout_engine(cfg: TrainConfig, parts: Parts, eng: EngineParts, rank0: bool):
    """What production and evaluation generate with: the engine, or with an environment every
    candidate a session with it (in split placement the sessions run on the rollout ranks)."""
    if not cfg.rollout.agent.env:
        return eng.engine
    split = cfg.placement.mode == "split"
    engine, report = agent_engine(cfg, parts.tok, None if split else eng.engine)
    if rank0:
        print(f"rollout.agent.env={cfg.rollout.agent.env}: chat template {report.rule}", flush=True)
    return eng.engine if split else engine


def _production_variants(cfg: TrainConfig) -> dict:
    """The producer's admission (generation ahead within the staleness bound, asynchronous RL)
    and observers (the agent episodes' metrics), as the config asks."""
    admission = None
    if cfg.async_rl.max_staleness > 0 and not cfg.async_rl.partial_rollouts:  # generation runs ahead, within the bound
        admission = AheadAdmission(cfg.trainer, cfg.rollout, cfg.async_rl, routing_replay=cfg.algo.routing_replay)
    observers = []
    if cfg.rollout.agent.env:
        observers.append(AgentEpisodeMetrics())
    return {"admission": admission, "observers": observers}


def wire_components(cfg: TrainConfig, parts: Parts, eng: EngineParts, *, sm: IterationStateMachine,
                    progress: RunProgress, run_dir: str, run_id: str, dp: int, rank0: bool,
                    ckpt_root: str) -> Components:
    """The phase components of the iteration over the built parts: publication, production
    (with its scorer), preparation, learning (through the fault seam when faults are set) and
    evaluation (scoring without training-only shaping)."""
    counters = progress.counters
    quarantine = os.path.join(run_dir, "quarantine.jsonl")
    time_slice = EngineTimeSlice(eng.engine, cfg.rollout.backend == "sglang" and cfg.rollout.enable_memory_saver,
                                 keep_weights=_engine_adapter(cfg) is not None)

    def scorer(shape_overlong: bool) -> Scorer:
        return make_scorer(cfg, parts.tok, parts.reward_runner, parts.reward_models, counters, quarantine, rank0,
                           shape_overlong=shape_overlong, judges=parts.judges)

    agentic = bool(cfg.rollout.agent.env)
    rollout_engine = _rollout_engine(cfg, parts, eng, rank0)

    publisher = WeightPublisher(
        actor=parts.actor, critic=parts.critic, engine=eng.engine, placement=eng.placement, sm=sm,
        time_slice=time_slice, counters=counters, sync_dtype=eng.sync_dtype, bucket_mb=cfg.rollout.bucket_mb,
        max_retries=cfg.rollout.max_retries, corrupt_at=cfg.faults.corrupt_weight_sync_at, injector=parts.injector,
        rank0=rank0, changed_only=_lora_sync_names(cfg, parts.actor), adapter=_engine_adapter(cfg))
    producer_class, variant = GroupRolloutProducer, {}
    if cfg.async_rl.partial_rollouts:  # complete groups train, unfinished ones carry over
        producer_class, variant = PartialRolloutProducer, {"async_rl": cfg.async_rl}
    stops = eng.stop_token_ids
    if agentic:  # a session's turn also ends on the template's end of an assistant turn
        stops = tuple(dict.fromkeys([*stops, *EnvTurnRenderer(parts.tok).assistant_end_ids]))
    producer = producer_class(
        cfg.trainer, cfg.rollout, cfg.algo, **variant, grouped=advantage_needs(cfg.algo.advantage).groups, train_data=parts.train_data, sampler=parts.sampler,
        engine=rollout_engine, placement=eng.placement,
        scorer=episode_scorer(cfg, parts.tok, counters, quarantine, rank0) if agentic else scorer(True), sm=sm,
        counters=counters, run_id=run_id, quarantine_path=quarantine, stop_token_ids=stops,
        checks=component_checks(parts.reward_fn) if parts.reward_fn is not None else ((), ()),
        **_production_variants(cfg))
    preparer = ExperiencePreparer(
        cfg.algo, cfg.async_rl, LogProbParity.of(cfg.rollout), actor=parts.actor, reference=parts.reference,
        critic=parts.critic, teacher=parts.teacher, time_slice=time_slice, sm=sm,
        kl_ctl=parts.kl_ctl, progress=progress, pad_id=eng.pad_id, run_id=run_id,
        save_dir=os.path.join(run_dir, "experience") if cfg.trainer.save_experience and rank0 else None,
        proximal_engine=eng.engine if cfg.async_rl.proximal_log_probs == "engine" else None,
        rollout_precision="" if eng.sync_dtype is None else str(eng.sync_dtype).removeprefix("torch."))
    learning_actor = parts.actor
    if parts.injector is not None:
        learning_actor = FaultyActor(parts.actor, parts.injector, cfg.algo.ppo_epochs * cfg.algo.num_mini_batches)
    learner = Learner(cfg, actor=learning_actor, critic=parts.critic, sm=sm, kl_ctl=parts.kl_ctl, counters=counters,
                      dp=dp, sync_dtype=eng.sync_dtype, rank0=rank0, ckpt_root=ckpt_root,
                      demonstrations=parts.demonstrations, pad_id=eng.pad_id)
    eval_scorer = episode_scorer(cfg, parts.tok, counters, quarantine, rank0) if agentic else scorer(False)
    if cfg.eval.grader is not None:  # the held-out accuracy is that rule's
        eval_scorer = grader_scorer(cfg, parts.tok, parts.grader_runner, counters, quarantine, rank0)
    evaluator = Evaluator(cfg.eval, parts.heldout, engine=rollout_engine, placement=eng.placement,
                          scorer=eval_scorer,
                          progress=progress, run_id=run_id, default_max_new_tokens=cfg.rollout.max_new_tokens,
                          max_retries=cfg.rollout.max_retries, decode=parts.tok.decode,
                          results_dir=os.path.join(run_dir, "eval") if cfg.eval.save_results and rank0 else None)
    return Components(publisher=publisher, producer=producer, preparer=preparer, learner=learner, evaluator=evaluator)

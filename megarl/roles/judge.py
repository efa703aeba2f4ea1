"""A generative judge: a causal LM that reads (prompt, response) through its own prompt, tokenizer
and chat template, writes a verdict through a rollout engine, and has it parsed by a declared
rule (:mod:`megarl.rewards.verdicts`).

It runs where the rule runner runs (rank 0) on an engine of its own (``engine``: the hf rollout
engine in-process, or an SGLang engine beside the rollout's taking ``mem_fraction_static`` of the
device; with ``offload``, the hf engine's weights wait on the host between scorings); the
verdicts are broadcast like the rule's records.  Its identity -- the weights' manifest, its tokenizer, its
template, its prompt and its sampling -- is its ``version``; a resume that would judge with
another is refused (megarl/control/persistence.py, origins).
"""

from __future__ import annotations

import hashlib
from typing import List, Mapping, Optional, Sequence

from megarl.data.tokenizer import TokenizerContract
from megarl.rewards.verdicts import Verdict, VerdictRule, parse_verdict, template_ground_truth_fields, yes_probability


def judge_input(contract: TokenizerContract, template: str, prompt_text: str, response_text: str,
                ground_truth: Optional[Mapping] = None, key: str = "reward.judges[i]") -> List[int]:
    """A judge's input ids: ``template`` filled with the sample (``{prompt}``, ``{response}``) and
    the row's ground-truth fields it names (``{answer}``), as one user turn through ``contract``'s
    chat template with the assistant's turn opened, or the text as it is without one.  (What a
    judge's warm start trains on: megarl/builtin/tasks/arithmetic_judge.py.)"""
    truth, reads = ground_truth or {}, template_ground_truth_fields(template)
    missing = [f for f in reads if truth.get(f) is None]
    if missing:  # the start-up check refuses such rows (megarl/rewards/dataset_fields.py)
        raise KeyError(f"{key}.prompt reads the row's {missing}; this sample's ground truth has {sorted(truth)}")
    text = template.format(prompt=prompt_text, response=response_text, **{f: str(truth[f]).strip() for f in reads})
    if contract.chat_template is not None:
        return contract.encode_prompt([{"role": "user", "content": text}], add_generation_prompt=True)
    return contract.tokenizer.encode(text, add_special_tokens=True)


class GenerativeJudge:
    """Args: ``cfg`` a ``reward.judges`` entry (JudgeConfig); ``key`` its config key; ``device``
    where its engine runs."""

    def __init__(self, cfg, key: str, device: str = "cpu"):
        from megarl.roles.reward_model import weights_manifest_digest
        from megarl.rollout.served_checkpoint import serve_checkpoint

        self.cfg, self.key = cfg, key
        self.contract = TokenizerContract.load(cfg.tokenizer or cfg.path, cfg.chat_template)
        self.rule = VerdictRule(cfg.verdict, cfg.yes, cfg.no, cfg.pattern)
        self.engine = serve_checkpoint(cfg.path, self.contract, device, run_id=f"judge-{cfg.name}", backend=cfg.engine,
                                       mem_fraction_static=cfg.mem_fraction_static)
        if cfg.offload:  # hf: the weights on the host until the next scoring (GPU; on CPU nothing moves)
            self.engine.sleep()
        from megarl.rollout.protocol import SamplingParams

        self.sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, n=1)
        h = lambda text: hashlib.sha256((text or "").encode()).hexdigest()[:8]  # noqa: E731
        rule = f"{cfg.verdict}:{cfg.yes}/{cfg.no}/{cfg.pattern}/p{int(cfg.probability)}"
        # the engine is part of the identity (its kernels are not the hf engine's); hf, the first
        # engine, keeps the identity it always had
        engine = "" if cfg.engine == "hf" else f"-e{cfg.engine}"
        self.version = (f"judge-{self.contract.hash[7:15]}-tpl{h(self.contract.chat_template)}-p{h(cfg.prompt)}-"
                        f"v{h(rule)}-t{cfg.temperature:g}x{cfg.max_new_tokens}{engine}-"
                        f"w{weights_manifest_digest(cfg.path)[:8]}-{cfg.path}")

    def render(self, messages: Optional[Sequence[dict]], prompt_text: str, response_text: str,
               ground_truth: Optional[Mapping] = None) -> List[int]:
        """The judge's input: its prompt filled with the sample (and, for a reference-guided judge,
        the row's ground-truth fields it names, e.g. ``{answer}``), as one user turn through its
        template (with the assistant's turn opened), or the text as it is without one."""
        return judge_input(self.contract, self.cfg.prompt, prompt_text, response_text, ground_truth, self.key)

    def judge(self, inputs: Sequence[Sequence[int]], request_ids: Sequence[str]) -> List[Verdict]:
        """One verdict per input, generated in batches of ``batch_size`` (``request_ids``: one per
        input, which seed a sampled verdict)."""
        if self.cfg.offload:
            self.engine.wake()
        try:
            return self._judge(inputs, request_ids)
        finally:
            if self.cfg.offload:
                self.engine.sleep()

    def _judge(self, inputs: Sequence[Sequence[int]], request_ids: Sequence[str]) -> List[Verdict]:
        from megarl.rollout.protocol import FinishReason, GenerationRequest

        out: List[Verdict] = []
        b = self.cfg.batch_size
        for lo in range(0, len(inputs), b):
            reqs = [GenerationRequest(rid, tuple(ids)) for rid, ids in zip(request_ids[lo:lo + b], inputs[lo:lo + b])]
            results = {r.request_id: r for r in self.engine.generate(reqs, self.sampling)}
            for req in reqs:
                r = results[req.request_id]
                ids = list(r.response_ids)
                text = self.contract.decode(ids, skip_special_tokens=True)
                v = parse_verdict(text, r.finish_reason is FinishReason.LENGTH, self.rule)
                if v.score is not None and self.cfg.probability:
                    v = Verdict(self._yes_probability(req.prompt_ids, ids, v.at), at=v.at, word=v.word)
                out.append(v)
        return out

    def _yes_probability(self, prompt_ids, response_ids, at: int) -> float:
        """P(yes) / (P(yes) + P(no)) where the verdict word begins: the generated tokens before it,
        then each word's tokens teacher-forced."""
        prefix = []
        for t in response_ids:  # the tokens whose text ends before the verdict word
            if len(self.contract.decode(prefix + [t], skip_special_tokens=True).rstrip()) > at:
                break
            prefix.append(t)
        enc = self.contract.tokenizer
        words = [enc.encode(w.strip(), add_special_tokens=False) for w in (self.cfg.yes, self.cfg.no)]
        context = tuple(prompt_ids) + tuple(prefix)
        _, lps = self.engine.teacher_force([context, context], words)
        return yes_probability(float(lps[0].sum()), float(lps[1].sum()))

    def close(self) -> None:
        self.engine.close()

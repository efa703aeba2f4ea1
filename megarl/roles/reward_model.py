"""The neural reward model: a value-head megatron model, eval only, with its own tokenizer.

Both head formats reward models are published in: ``*ForSequenceClassification`` (the score at
the last non-pad token, as transformers reads it) and ``*ForTokenClassification`` (the head's
output at the last token).

A reward model may have been trained with another tokenizer and chat template than the actor
(the same semantic response goes through each scorer's own versioned preprocessing), so it
never reads the actor's token ids: the semantic sample (the chat messages, or the prompt text,
plus the response text) is rendered with the RM's own template and tokenizer, and the score is
the head's output at the last token.  The mapping from sample to scorer input is kept (``inputs``)
so a score can be traced back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Mapping, Optional, Sequence

import torch

from megarl.data.scorer_input import render_for_scorer  # noqa: F401  (the scorers' rendering, re-exported)
from megarl.data.tokenizer import TokenizerContract
from megarl.models.forward import scalar_values
from megarl.models.hf_config import sequence_score_positions
from megarl.models.megatron_ckpt import load_model
from megarl.models.weights import unwrap
from megarl.roles.common import freeze
from megarl.runtime.data_parallel import map_rows


#: beside a reward model trained here: the user-turn template it was trained with (data.prompt)
SCORER_PROMPT_FILE = "megarl_scorer.json"


def write_scorer_prompt(model_dir: str, prompt: Optional[str]) -> None:
    """Record ``prompt`` (None included: trained on the prompt as it is) beside an exported model."""
    with open(os.path.join(model_dir, SCORER_PROMPT_FILE), "w") as f:
        json.dump({"prompt": prompt}, f, indent=1)


def recorded_scorer_prompt(model_dir: str):
    """``(True, prompt)`` when the model records the template it was trained with, else ``(False, None)``."""
    path = os.path.join(model_dir, SCORER_PROMPT_FILE)
    if not os.path.isfile(path):
        return False, None
    with open(path) as f:
        return True, json.load(f).get("prompt")


def input_digest(ids: Sequence[int]) -> str:
    """``sha256:<hex>`` of a scorer's input token ids: what the record keeps of it."""
    return "sha256:" + hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()


def add_component(base, name: str, score: float, weight: float, version: str, inputs: dict, **steps):
    """A neural scorer's ``score`` added to the ok record ``base`` (or standing alone when None) as
    the component ``name``, its total raised by ``weight * score`` and its version appended;
    ``steps``: a process model's ``step_rewards`` / ``step_token_ends``."""
    from megarl.experience.schema import RewardRecord

    comps = dict(base.components) if base is not None else {}
    comps[name] = score
    total = (base.total if base is not None else 0.0) + weight * score
    return RewardRecord(total=total, components=comps, inputs=inputs, **steps,
                        scorer_version=f"{base.scorer_version}+{version}" if base is not None else version)


def weights_manifest_digest(path: str) -> str:
    """sha256 of the tensor manifest (name, dtype, shape) the checkpoint's safetensors headers
    declare, in name order: read from the headers, no weight is loaded."""
    import glob

    from safetensors import safe_open

    entries = []
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                entries.append((name, str(sl.get_dtype()), list(sl.get_shape())))
    return hashlib.sha256(json.dumps(sorted(entries)).encode()).hexdigest()


class RewardModel:
    def __init__(self, path: str, tp: int, pp: int, tokenizer: Optional[str] = None,
                 chat_template: Optional[str] = None, vocab_multiple: int = 128, offload: bool = False,
                 micro_batch_size: int = 8, pack: bool = False, sequence_parallel: bool = False,
                 micro_batch_tokens: int = 0, key: str = "reward.model", prompt: Optional[str] = None):
        from megarl.errors import ConfigError

        self.model = load_model(path, tp=tp, pp=pp, vocab_multiple=vocab_multiple, sequence_parallel=sequence_parallel)
        spec = unwrap(self.model).megarl_spec
        if not spec.value_head:
            raise ConfigError(f"{key}.path: {path} is {spec.architecture}, not a reward model (expected an HF "
                              "*ForSequenceClassification or *ForTokenClassification with num_labels=1)")
        #: where the score is read: the last non-pad token (sequence classification), else the last token
        self.score_pad_id = spec.raw_config.get("pad_token_id") if spec.sequence_score else None
        self.sequence_score = spec.sequence_score
        freeze(self.model)
        self.contract = TokenizerContract.load(tokenizer or path, chat_template)
        # what it computes: its tokenizer, its template and its weights' manifest (the names, dtypes
        # and shapes its safetensors declare); the weights' content is the run's origins (state.json)
        template = hashlib.sha256((self.contract.chat_template or "").encode()).hexdigest()
        #: a reference-guided model's user turn (reward.models[i].prompt): part of what it computes
        self.prompt = prompt
        context = "" if prompt is None else f"-p{hashlib.sha256(prompt.encode()).hexdigest()[:8]}"
        self.version = (f"rm-{self.contract.hash[7:15]}-tpl{template[:8]}{context}-w{weights_manifest_digest(path)[:8]}-"
                        f"{path}")
        self.key = key  # the config entry it was built from (reward.model, reward.models[i])
        self.micro_batch_size = micro_batch_size
        self.pack = pack  # algo.pack_sequences: each micro-batch as one packed sequence
        self.micro_batch_tokens = micro_batch_tokens  # algo.micro_batch_tokens: packed, cut by tokens
        self.offloader = None
        if offload:
            from megarl.roles.offload import ReferenceOffloader

            self.offloader = ReferenceOffloader(self.model)
            self.offloader.offload()

    @torch.no_grad()
    def step_scores(self, inputs: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> list:
        """The head at each row's ``positions`` (collective; a process reward model's steps)."""
        ctx = self.offloader.on_device() if self.offloader is not None else contextlib.nullcontext()
        with ctx:
            return position_scores(self.model, inputs, positions, self.contract.pad_token_id or 0,
                                   self.micro_batch_size)

    def encode(self, messages: Optional[Sequence[dict]], prompt_text: str, response_text: str,
               ground_truth: Optional[Mapping] = None) -> list[int]:
        """The RM's own rendering of (prompt, response); a reference-guided model's user turn is its
        ``prompt`` filled with the turn and the row's ``ground_truth`` fields."""
        return render_for_scorer(self.contract, messages, prompt_text, response_text, self.prompt, ground_truth,
                                 key=f"{self.key}.prompt")

    @torch.no_grad()
    def score(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """``(n,)`` float scores, the head at each sequence's last token -- its last non-pad token
        for a sequence-classification head (collective: every rank passes the same ``inputs``;
        rows are split over DP)."""
        ctx = self.offloader.on_device() if self.offloader is not None else contextlib.nullcontext()
        with ctx:
            return sequence_scores(self.model, inputs, self.contract.pad_token_id or 0, self.score_pad_id,
                                   self.sequence_score, self.micro_batch_size, pack=self.pack,
                                   micro_batch_tokens=self.micro_batch_tokens)


@torch.no_grad()
def position_scores(model, inputs: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], pad_id: int,
                    micro_batch_size: int) -> list:
    """The head's output at given ``positions`` of each row (a process reward model's step
    reads): one float tensor per row.  Collective: every rank passes the same rows; they are
    split over DP."""
    n = len(inputs)
    L = max(len(x) for x in inputs)
    S = max(1, max(len(p) for p in positions))
    tokens = torch.full((n, L), pad_id, dtype=torch.long)
    at = torch.zeros((n, S), dtype=torch.long)
    for i, (x, p) in enumerate(zip(inputs, positions, strict=True)):
        tokens[i, :len(x)] = torch.tensor(list(x), dtype=torch.long)
        at[i, :len(p)] = torch.tensor(list(p), dtype=torch.long)
    lengths = torch.tensor([len(x) for x in inputs], dtype=torch.long)

    def run(tok, ln, where):
        v = scalar_values(model, tok, micro_batch_size, lengths=ln)
        return v.gather(1, where.to(v.device)).float()

    out = map_rows(run, tokens, lengths, at).cpu()
    return [out[i, :len(p)] for i, p in enumerate(positions)]


@torch.no_grad()
def sequence_scores(model, inputs: Sequence[Sequence[int]], pad_id: int, score_pad_id: Optional[int],
                    sequence_score: bool, micro_batch_size: int, pack: bool = False,
                    micro_batch_tokens: int = 0) -> torch.Tensor:
    """``(n,)`` float scores of a value-head ``model`` on token rows ``inputs`` (padded with
    ``pad_id``): the head at each row's last non-``score_pad_id`` token when ``sequence_score``
    (HF *ForSequenceClassification), else at its last token.  Collective: every rank passes the
    same rows; they are split over DP."""
    n = len(inputs)
    L = max(len(x) for x in inputs)
    tokens = torch.full((n, L), pad_id, dtype=torch.long)
    for i, x in enumerate(inputs):
        tokens[i, :len(x)] = torch.tensor(list(x), dtype=torch.long)
    lengths = torch.tensor([len(x) for x in inputs], dtype=torch.long)

    def run(tok, ln):
        v = scalar_values(model, tok, micro_batch_size, lengths=ln, pack=pack, micro_batch_tokens=micro_batch_tokens)
        at = sequence_score_positions(tok, ln, score_pad_id) if sequence_score else (ln - 1).clamp(min=0)
        return v.gather(1, at[:, None].to(v.device))[:, 0].float()

    return map_rows(run, tokens, lengths).cpu()

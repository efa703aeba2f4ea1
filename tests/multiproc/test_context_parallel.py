"""Context parallelism (``parallel.cp``, ``megarl/models/context_parallel.py``).

* The zig-zag layout: every position on exactly one CP rank, two chunks each, megatron's RoPE
  layout (``get_pos_emb_on_this_cp_rank``); the labels shifted on the whole row.
* Against no context parallelism, from one checkpoint (one torchrun launch of 4 processes,
  ``tests/workers/context_parallel_worker.py``): the actor's log-probs, one PPO update of the real
  ``Learner`` (actor and critic: gradient norms, losses, every weight after two SGD steps) and the
  log-probs and values after it, at CP=2, CP=2 x TP=2 (with and without sequence parallelism, the
  former with full activation recomputation) and CP=2 x PP=2.  The attention is the CPU stand-in in ``megarl/models/cpu_layers.py``
  (``context_parallel_core_attention``); transformer-engine's is a row of ``tests/gpu/run.sh``.
* The same at every CP layout with token-budget micro-batches (packed THD sequences, each split over
  the CP ranks on its own; rows padded at their ends to multiples of 2 x cp), against the same
  padded CP=1 reference.
* Negative controls: labels shifted on each rank's share (verl PR #4250), and the gathered
  terms' gradient summed over CP ranks (every gradient times cp): both caught by the same bounds.
"""

import pytest
import torch
from safetensors.torch import load_file

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.models import context_parallel
from tests._dist import ROOT, torchrun
from tests._tolerance import within

LAYOUTS = ["cp2", "cp2tp2", "cp2tp2sp", "cp2pp2"]


def test_zigzag_layout():
    for cp in (1, 2, 3, 4):
        for length in (2 * cp, 6 * cp, 16 * cp):
            held = [context_parallel.positions(length, cp, r) for r in range(cp)]
            assert sorted(torch.cat(held).tolist()) == list(range(length)), "every position on exactly one rank"
            c = length // (2 * cp)
            for r, pos in enumerate(held):
                # chunks r and 2cp-1-r: the early and the late part of a causal sequence on one rank
                assert pos.tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c,
                                                                                    (2 * cp - r) * c))
            assert torch.equal(context_parallel.all_positions(length, cp), torch.cat(held))
    with pytest.raises(ValueError, match="2 x cp = 4 equal chunks"):
        context_parallel.positions(6, 2, 0)


def test_zigzag_layout_is_megatrons_rope_layout():
    """megatron picks each CP rank's RoPE rows with get_pos_emb_on_this_cp_rank: the same positions."""
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    from megarl.runtime import cpu_compat

    class Group:
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def rank(self):
            return self._rank

    cpu_compat.install()  # (inert on CUDA) megatron pins the chunk index: the CPU mode drops that
    emb = torch.arange(24, dtype=torch.float32)[:, None, None, None]
    for cp in (2, 3):
        for r in range(cp):
            with cpu_compat.megatron_scope():
                got = get_pos_emb_on_this_cp_rank(emb, 0, Group(cp, r))
            assert got.flatten().long().tolist() == context_parallel.positions(24, cp, r).tolist()


def test_labels_shift_on_the_whole_row():
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    assert context_parallel.shifted_labels(tokens).tolist() == [[6, 7, 8, 9, 10, 11, 12, 0]]


def test_config_refuses_what_does_not_run_split():
    from megarl.config.validation import validate

    recipe = f"{ROOT}/configs/grpo_arith_tiny.yaml"
    with pytest.raises(ConfigError, match="parallel.cp"):
        validate(load_config(recipe, ["parallel.cp=2"]), 3)
    for key, value in (("algo.routing_replay", "rollout"), ("actor.moe_aux_loss_coeff", "0.01")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(load_config(recipe, ["parallel.cp=2", f"{key}={value}"]), 4)
    assert validate(load_config(recipe, ["parallel.cp=2", "parallel.ep=2"]), 4) == 2  # MoE: experts over CP x DP
    assert validate(load_config(recipe, ["parallel.cp=2"]), 4) == 2  # dp = world / (tp x pp x cp)
    assert validate(load_config(recipe, ["parallel.cp=2", "algo.micro_batch_tokens=64"]), 4) == 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("context_parallel")
    hf = make_tiny_hf_checkpoint(str(root / "llama"), "llama", seed=3, vocab_size=300)
    torchrun("context_parallel_worker.py", 4, "--hf", hf, "--out", str(root))
    return torch.load(root / "context_parallel.pt"), load_file(f"{hf}/model.safetensors")


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("layout", LAYOUTS + [f"{layout}_tokens" for layout in LAYOUTS])
def test_context_parallel_equals_no_context_parallelism(runs, layout):
    results, initial = runs
    base, got = results["cp1"], results[layout]
    # what ran: the stand-in CP attention, on padded rows or on packed (THD) sequences only
    packed = layout.endswith("_tokens")
    assert got["attention"].get("thd" if packed else "padded", 0) > 0, got["attention"]
    assert got["attention"].get("padded" if packed else "thd", 0) == 0, got["attention"]
    assert "attention" not in base or not base["attention"], "CP=1 runs megatron's own attention"
    assert all(p == packed for step in got["packed"] for p in step) and got["packed"], got["packed"]
    moved = max((base["actor"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3, "the update did not move the actor; the comparison would be vacuous"
    assert base["values_after"].abs().max() > 0.5, "the critic's values after the update must not be vacuous"
    # log-probs of ~-6: a fp32 softmax over 304 entries summed in another order, ~1e-7 relative
    for key in ("log_probs", "log_probs_after"):
        err = (got[key] - base[key]).abs().max().item()
        assert within(err, 1e-5, f"context_parallel/{layout}/{key}"), (key, err)
    # values of ~2 from a critic whose weights differ by ~3e-7 (an SGD step at lr 0.5 of a
    # gradient of norm ~9 summed in another order)
    for key in ("values_after", "bootstrap_after"):
        err = (got[key] - base[key]).abs().max().item()
        assert within(err, 5e-5, f"context_parallel/{layout}/{key}"), (key, err)
    m, b = got["metrics"], base["metrics"]
    assert m["update/tokens"] == b["update/tokens"] and m["update/optimizer_steps"] == b["update/optimizer_steps"] == 2
    # one loss, one normaliser: the metrics are the replica's, never summed over CP ranks
    for key in ("update/grad_norm", "update/critic_grad_norm", "update/pg_loss", "update/entropy", "update/kl_loss",
                "update/critic_value_loss"):
        assert within(_rel(m[key], b[key]), 1e-6, f"context_parallel/{layout}/{key}"), (key, m[key], b[key])
    for role in ("actor", "critic"):
        err = max((got[role][k] - base[role][k]).abs().max().item() for k in base[role])
        assert within(err, 1e-6, f"context_parallel/{layout}/{role}_weights"), (role, err)


def test_negative_controls(runs):
    """The bounds above catch the two mistakes the anchors made."""
    results, _ = runs
    base = results["cp1"]
    # each rank shifting its own share: the last position of a chunk predicts a token of its own
    # chunk instead of the next chunk's first -- wrong by far more than the bound
    err = (results["control_labels_per_share"] - base["log_probs"]).abs().max().item()
    assert err > 0.05, err
    # the gathered terms' gradient summed over CP: the actor's gradient doubles (cp = 2)
    ratio = results["control_summed_gradient"]["update/grad_norm"] / base["metrics"]["update/grad_norm"]
    assert abs(ratio - 2.0) < 0.1, ratio

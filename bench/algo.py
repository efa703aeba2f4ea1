"""CPU timings of the algorithm core, per million response (action) tokens.

    python bench/algo.py [--bs 512] [--response-len 1024] [--prompt-len 256] [--repeats 3]

Prints one line per stage: advantage estimators, packing / unpacking, and the actor loss
(forward + backward on the log-prob tensors) for the policy losses and aggregation modes.
"""

from __future__ import annotations

import argparse
import time

import torch

from megarl.algo.advantages import AdvantageConfig, AdvantageInputs
from megarl.algo.aggregation import global_normaliser
from megarl.algo.kl import KLConfig
from megarl.algo.objective import actor_loss
from megarl.algo.policy_loss import PolicyLossConfig
from megarl.algo.registry import get_advantage
from megarl.experience.packing import pack, pack_layout, unpack_response
from megarl.experience.schema import LogProbProducer, LogProbs


def make(bs: int, P: int, R: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, P + 1, (bs,), generator=g)
    rlen = torch.randint(1, R + 1, (bs,), generator=g)
    pos = torch.arange(P + R)
    attn = ((pos >= (P - plen)[:, None]) & (pos < (P + rlen)[:, None])).long()
    rmask = attn[:, P:].clone()
    lp = -torch.rand(bs, R, generator=g) * 3
    return {
        "P": P,
        "attn": attn,
        "mask": rmask,
        "scores": torch.randn(bs, generator=g),
        "group_index": torch.arange(bs) // 8,
        "token_rewards": torch.randn(bs, R, generator=g) * rmask * 0.1,
        "values": torch.randn(bs, R, generator=g),
        "terminated": torch.rand(bs, generator=g) < 0.7,
        "boot": torch.randn(bs, generator=g),
        "lp": lp,
        "old": lp + torch.randn(bs, R, generator=g) * 0.1,
        "ref": lp + torch.randn(bs, R, generator=g) * 0.2,
        "adv": torch.randn(bs, R, generator=g),
        "entropy": torch.rand(bs, R, generator=g),
        "full": -torch.rand(bs, P + R, generator=g),
    }


def timeit(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    d = make(a.bs, a.prompt_len, a.response_len)
    n_tok = int(d["mask"].sum())
    per_m = 1e6 / n_tok
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, bs={a.bs} response_len={a.response_len} "
          f"prompt_len={a.prompt_len}, {n_tok} response tokens; best of {a.repeats}, reported as ms per 1M response tokens")  # fmt: skip
    cfg = AdvantageConfig(gamma=0.99, lam=0.95)
    m = d["mask"]
    stages = {
        "adv grpo": lambda: get_advantage("grpo")(AdvantageInputs(response_mask=m, scores=d["scores"], group_index=d["group_index"]), cfg),
        "adv rloo": lambda: get_advantage("rloo")(AdvantageInputs(response_mask=m, scores=d["scores"], group_index=d["group_index"]), cfg),
        "adv gae": lambda: get_advantage("gae")(
            AdvantageInputs(response_mask=m, token_rewards=d["token_rewards"], values=d["values"], terminated=d["terminated"], bootstrap_values=d["boot"]), cfg
        ),
        "adv reinforce++": lambda: get_advantage("reinforce_plus_plus")(AdvantageInputs(response_mask=m, token_rewards=d["token_rewards"]), cfg),
    }
    layout = pack_layout(d["attn"], d["P"])
    packed = pack(d["full"], layout)
    stages["pack_layout+pack"] = lambda: pack(d["full"], pack_layout(d["attn"], d["P"]))
    stages["unpack_response"] = lambda: unpack_response(packed, layout)
    actor = LogProbProducer("actor", "v1")
    ref = LogProbProducer("reference", "r0")
    for name, mode in [("vanilla", "token-mean"), ("vanilla", "seq-mean-token-mean"), ("gspo", "seq-mean-token-mean")]:
        pcfg = PolicyLossConfig(name=name, agg_mode=mode, entropy_coef=0.01, kl=KLConfig(placement="loss", estimator="k3", beta=0.01))
        norm = global_normaliser(m, mode)

        def loss_fb(pcfg=pcfg, norm=norm):
            lp = d["lp"].clone().requires_grad_(True)
            ent = d["entropy"].clone().requires_grad_(True)
            out = actor_loss(
                lp, old_log_probs=LogProbs(d["old"], actor), advantages=d["adv"], loss_mask=m, cfg=pcfg,
                normaliser=norm, ref_log_probs=LogProbs(d["ref"], ref), entropy=ent,
            )  # fmt: skip
            out.loss.backward()

        stages[f"loss fwd+bwd {name} {mode} (+k3 KL, entropy)"] = loss_fb
    for label, fn in stages.items():
        t = timeit(fn, a.repeats)
        print(f"{label:58s} {t * per_m * 1e3:9.1f} ms / 1M tokens")


if __name__ == "__main__":
    main()

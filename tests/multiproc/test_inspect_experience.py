"""tools/inspect_experience.py: one sample of a sealed batch (ids, version, tokens, per-token
table, reward record), a one-line-per-sample listing, and corruption refused with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
from megarl.experience.schema import (
    DerivedTensors,
    ExperienceBatch,
    ExperienceFacts,
    FinishReason,
    LogProbProducer,
    LogProbs,
    RewardRecord,
    RewardStatus,
    SamplingConfig,
)
from megarl.experience.origins import collate_origins
from megarl.experience.seal import save_sealed, seal, with_derived

from tests._dist import ROOT
TOOL = os.path.join(ROOT, "tools", "inspect_experience.py")
VERSION = "v3.0-1a2b3c4d"
SIDS = ("runX/it5/p0/c00", "runX/it5/p0/c01", "runX/it5/p1/c00")
# advantages of sample 1 (real response tokens 0..3); printed with 4 decimals
ADV1 = [1.25, -0.75, 0.3125, 2.0625]


def _build(tok) -> ExperienceBatch:
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos, pad = tok.eos_token_id, tok.pad_token_id
    prompts = [enc("what is 2 plus 3"), enc("what is 2 plus 3"), enc("compute 7 times 6")]
    responses = [enc("5") + [eos], enc("the answer is 5") + [eos], enc("4 2 so the answer")]
    P = max(map(len, prompts))
    R = max(map(len, responses))
    bs = len(prompts)
    prompt_ids = torch.full((bs, P), pad, dtype=torch.int64)
    response_ids = torch.full((bs, R), pad, dtype=torch.int64)
    attn = torch.zeros(bs, P + R, dtype=torch.int64)
    rmask = torch.zeros(bs, R, dtype=torch.int64)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[b, P - len(p):] = torch.tensor(p)
        response_ids[b, : len(r)] = torch.tensor(r)
        attn[b, P - len(p): P + len(r)] = 1
        rmask[b, : len(r)] = 1
    rmask[1, 1] = 0  # a non-action token inside sample 1's response
    # ... which makes sample 1 a multi-turn trajectory: token 1 is environment output between
    # two policy turns (sealing refuses it without token origins; its rollout log-prob is 0)
    sources = [[1] * len(r) for r in responses]
    sources[1][1] = 2
    turns = [[0] * len(r) for r in responses]
    turns[1] = [0, 0] + [1] * (len(responses[1]) - 2)
    origins = collate_origins(sources, turns, [[None if x == 2 else VERSION for x in row] for row in sources], R)
    g = torch.Generator().manual_seed(0)
    lp = lambda: -torch.rand(bs, R, generator=g)  # noqa: E731
    rollout = lp()
    rollout[1, 1] = 0.0
    facts = ExperienceFacts(
        run_id="runX",
        iteration=5,
        prompt_id=("p0", "p0", "p1"),
        group_id=("runX/it5/p0", "runX/it5/p0", "runX/it5/p1"),
        sample_id=SIDS,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        attention_mask=attn,
        response_mask=rmask,
        finish_reason=(FinishReason.EOS, FinishReason.EOS, FinishReason.LENGTH),
        policy_version=(VERSION,) * bs,
        sampling=SamplingConfig(temperature=0.7, top_p=0.95, max_new_tokens=R, n=2, stop_token_ids=(eos,)),
        request_id=("req-a", "req-b", "req-c"),
        seed=(11, 12, None),
        rewards=(
            RewardRecord(total=1.0, components={"correctness": 1.0}, scorer_version="rule-v2"),
            RewardRecord(total=1.25, components={"correctness": 1.0, "format": 0.25}, scorer_version="rule-v2"),
            RewardRecord(total=None, scorer_version="rule-v2", status=RewardStatus.TIMEOUT,
                         error="verifier timed out after 5s"),
        ),
        rollout_log_probs=LogProbs(rollout, LogProbProducer("rollout", VERSION, "processed")),
        old_log_probs=LogProbs(lp(), LogProbProducer("actor", VERSION, "raw")),
        ref_log_probs=LogProbs(lp(), LogProbProducer("reference", "ref-0", "raw")),
        values=torch.randn(bs, R, generator=g),
        critic_version="critic-9",
        token_origins=origins,
    )
    sealed = seal(ExperienceBatch(facts))
    adv = torch.zeros(bs, R)
    adv[1, :4] = torch.tensor(ADV1)
    returns = adv + 0.5
    loss_mask = rmask.clone()
    loss_mask[2] = 0  # the timed-out sample is excluded from the loss
    derived = DerivedTensors(advantages=adv, loss_mask=loss_mask, returns=returns,
                             estimator="grpo", hyperparameters={"norm_std": True})
    return with_derived(sealed, derived)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inspect")
    tok = build_tiny_tokenizer(tmp / "tok")
    batch = _build(tok)
    save_sealed(batch, tmp / "exp")
    return tmp, batch


def _run(*args):
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _assert_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for frag in fragments:
        assert frag in lines[0], (frag, lines[0])


def test_one_sample_with_tokenizer(saved):
    tmp, batch = saved
    proc = _run(tmp / "exp", "--index", 1, "--tokenizer", tmp / "tok")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for s in (SIDS[1], VERSION, "runX", "req-b", "finish_reason   eos", "temperature=0.7", "top_p=0.95",
              "role=rollout version=" + VERSION + " space=processed", "role=actor", "role=reference version=ref-0",
              "critic_version=critic-9", "estimator=grpo",
              "what is 2 plus 3", "the answer is 5",                  # decoded prompt / response
              "correctness=1, format=0.25", "scorer_version  rule-v2", "total           1.25",
              "status          ok", batch.content_hash):
        assert s in out, f"{s!r} missing from:\n{out}"
    for a in ADV1:
        assert f"{a:.4f}" in out
    # the per-token table: header with every column, one row per real response token
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["pos", "token", "text"])
    assert lines[head].split() == ["pos", "token", "text", "response_mask", "loss_mask", "rollout_lp", "old_lp",
                                   "ref_lp", "value", "advantage", "return"]
    rows = [line.split() for line in lines[head + 2: head + 2 + 5]]
    n_real = int(batch.facts.attention_mask[1, batch.facts.prompt_len:].sum())
    assert [r[0] for r in rows[:n_real]] == [str(t) for t in range(n_real)]
    ids = batch.facts.response_ids[1].tolist()
    assert [int(r[1]) for r in rows[:n_real]] == ids[:n_real]
    assert rows[1][3] == "0" and rows[0][3] == "1"                      # the non-action token
    assert rows[1][2] == '"answer"' and rows[2][2] == '"is"'
    old = batch.facts.old_log_probs.values[1].tolist()
    assert rows[2][6] == f"{old[2]:.4f}"
    assert rows[3][9] == f"{ADV1[3]:.4f}" and rows[3][10] == f"{ADV1[3] + 0.5:.4f}"

    by_id = _run(tmp / "exp", "--sample", SIDS[1], "--tokenizer", tmp / "tok")
    assert by_id.returncode == 0 and by_id.stdout == out


def test_default_sample_without_tokenizer_and_failed_reward(saved):
    tmp, batch = saved
    proc = _run(tmp / "exp")
    assert proc.returncode == 0, proc.stderr
    assert SIDS[0] in proc.stdout and "text" not in proc.stdout.split("per-token")[1].splitlines()[1]
    assert "  text:" not in proc.stdout
    ids = batch.facts.response_ids[0].tolist()[:2]
    assert f"ids: {ids}" in proc.stdout

    proc = _run(tmp / "exp", "--index", -1)
    assert proc.returncode == 0, proc.stderr
    for s in (SIDS[2], "status          timeout", "verifier timed out after 5s", "total           -",
              "finish_reason   length", "seed            -", "prompt: 4 tokens (1 left padding)"):
        assert s in proc.stdout, s


def test_list(saved):
    tmp, batch = saved
    proc = _run(tmp / "exp", "--list")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert batch.content_hash in lines[0] and "samples=3" in lines[0]
    assert lines[1].split() == ["index", "sample_id", "version", "finish", "reward", "status", "resp_len", "actions"]
    rows = [line.split() for line in lines[2:]]
    lengths = batch.facts.attention_mask[:, batch.facts.prompt_len:].sum(1).tolist()
    assert rows == [
        ["0", SIDS[0], VERSION, "eos", "1", "ok", str(lengths[0]), str(lengths[0])],
        ["1", SIDS[1], VERSION, "eos", "1.25", "ok", str(lengths[1]), str(lengths[1] - 1)],
        ["2", SIDS[2], VERSION, "length", "-", "timeout", str(lengths[2]), str(lengths[2])],
    ]


def test_bad_selection(saved):
    tmp, _ = saved
    _assert_error(_run(tmp / "exp", "--index", 3), "--index 3 out of range", "3 samples")
    _assert_error(_run(tmp / "exp", "--sample", "runX/it5/p9"), "'runX/it5/p9' is not in this batch")
    _assert_error(_run(tmp / "nope"), "nope", "not found")
    _assert_error(_run(tmp / "tok"), "manifest.json", "not found")
    _assert_error(_run(tmp / "exp", "--tokenizer", tmp / "missing-tok"), "missing-tok")


def test_flipped_byte_and_tampered_manifest(saved, tmp_path):
    src, batch = saved
    exp = tmp_path / "exp"
    save_sealed(batch, exp)
    path = exp / "experience.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01
    path.write_bytes(bytes(raw))
    _assert_error(_run(exp, "--index", 1), str(path), "sha256")

    exp2 = tmp_path / "exp2"
    save_sealed(batch, exp2)
    mpath = exp2 / "manifest.json"
    m = json.loads(mpath.read_text())
    m["metadata"]["rewards"][0]["total"] = 99.0
    mpath.write_text(json.dumps(m))
    _assert_error(_run(exp2, "--list"), str(mpath), "content hash")

    mpath.write_text("{not json")
    _assert_error(_run(exp2), str(mpath))

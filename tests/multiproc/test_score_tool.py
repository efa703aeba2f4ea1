"""tools/score.py: teacher-forced log-probs of JSONL token ids, for HF and megarl checkpoints,
equal to transformers' within 1e-4 and written in input order."""

import json
import os
import subprocess
import sys

import torch

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from tests._dist import ROOT, torchrun
from tests._tolerance import NET_FP32_LOGPROB, within

SCORE = os.path.join(ROOT, "tools", "score.py")
CONVERT = os.path.join(ROOT, "tools", "convert_checkpoint.py")


def _expected(hf, seqs):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            t = torch.tensor([s])
            lp = torch.log_softmax(m(t).logits.float(), -1)[0, :-1].gather(-1, t[0, 1:, None])[:, 0]
            out.append(lp)
    return out


def test_score_hf_at_tp2_and_megatron_checkpoint(tmp_path):
    hf = make_tiny_hf_checkpoint(str(tmp_path / "hf"), "qwen3", seed=2)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (int(n),), generator=g).tolist() for n in (9, 3, 14, 5, 2, 11, 7)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in seqs))
    want = _expected(hf, seqs)

    out_tp2 = tmp_path / "tp2.jsonl"
    torchrun(SCORE, 2, "--model", hf, "--input", str(inp), "--out", str(out_tp2), "--tp", "2",
             "--micro-batch-size", "3")

    meg = str(tmp_path / "meg")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    conv = subprocess.run([sys.executable, CONVERT, "hf-to-megatron", "--hf", hf, "--out", meg],
                          capture_output=True, text=True, env=env)
    assert conv.returncode == 0, conv.stdout[-3000:] + conv.stderr[-3000:]
    out_meg = tmp_path / "meg.jsonl"
    proc = subprocess.run([sys.executable, SCORE, "--model", meg, "--input", str(inp), "--out",
                           str(out_meg)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    for path in (out_tp2, out_meg):
        lines = [json.loads(ln) for ln in path.read_text().splitlines()]
        assert len(lines) == len(seqs)
        for s, w, got in zip(seqs, want, lines):
            assert len(got["token_logprobs"]) == len(s) - 1
            # fp32, megatron (TP=2, or a megatron checkpoint) vs transformers: two implementations
            err = (torch.tensor(got["token_logprobs"]) - w).abs().max().item()
            assert within(err, NET_FP32_LOGPROB, f"score_tool/{path.name}"), (path.name, err)


def test_score_rejects_bad_lines(tmp_path):
    hf = make_tiny_hf_checkpoint(str(tmp_path / "hf"), "llama", seed=2)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"token_ids": [1, 2, 3]}) + "\n" + json.dumps({"ids": [1]}) + "\n")
    proc = subprocess.run([sys.executable, SCORE, "--model", hf, "--input", str(inp), "--out",
                           str(tmp_path / "o.jsonl")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "in.jsonl:2" in proc.stderr and "token_ids" in proc.stderr
    assert "Traceback" not in proc.stderr

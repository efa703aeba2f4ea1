"""Sources (issue 18, item 7): Hub ids resolved offline from a prepared Hub cache, prompt rows
from `datasets` directories, file directories and Hub datasets, the GSM8K / MATH prep tools
scored by the real math_verify reward, and the example reward plug-in."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
from megarl.data.hub import HubSourceError, is_hub_id, resolve_source, resolve_sources
from megarl.data.prompts import PromptDatasetError, iter_rows, load_prompt_dataset
from megarl.data.tokenizer import TokenizerContract
from tests._dist import subprocess_env

from tests._dist import ROOT
REPO = "megarl-test/tiny-llama"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


# ---- a real Hub cache, laid out the way huggingface_hub writes it ------------------------------------


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_to_hub_cache(cache: str, repo: str, src_dir: str, commit: str, ref: str = "main") -> str:
    """Put the files of ``src_dir`` into ``cache`` as snapshot ``commit`` of model repo ``repo``:
    ``models--org--name/{blobs/<hash>, snapshots/<commit>/<file> -> ../../blobs/<hash>,
    refs/<ref>}``, blobs named like huggingface_hub names them (sha256 for LFS files, the git
    blob sha1 otherwise).  Returns the snapshot directory."""
    storage = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snap = os.path.join(storage, "snapshots", commit)
    os.makedirs(os.path.join(storage, "blobs"), exist_ok=True)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
    for name in sorted(os.listdir(src_dir)):
        data = open(os.path.join(src_dir, name), "rb").read()
        blob = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else _git_blob_sha1(data)
        with open(os.path.join(storage, "blobs", blob), "wb") as f:
            f.write(data)
        link = os.path.join(snap, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", "..", "blobs", blob), link)
    with open(os.path.join(storage, "refs", ref), "w") as f:
        f.write(commit)
    return snap


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny llama HF checkpoint (random weights) with the tiny tokenizer and chat template."""
    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint

    d = tmp_path_factory.mktemp("tinyhub")
    build_tiny_tokenizer(str(d / "tok"))
    return make_tiny_hf_checkpoint(str(d / "ckpt"), "llama", seed=5, tokenizer_dir=str(d / "tok"),
                                   hidden_size=32, intermediate_size=64)


@pytest.fixture
def hub_cache(tmp_path, tiny_ckpt, monkeypatch):
    """An offline Hub cache holding ``REPO`` at COMMIT_A (refs/main) and COMMIT_B."""
    cache = str(tmp_path / "hub")
    add_to_hub_cache(cache, REPO, tiny_ckpt, COMMIT_B)
    add_to_hub_cache(cache, REPO, tiny_ckpt, COMMIT_A)  # refs/main -> A
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for k in ("LOCAL_RANK", "RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    return cache


def test_hub_id_or_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("meta-llama/Llama-3.1-8B@main")
    assert not is_hub_id("org/model")            # an existing directory is a path
    assert not is_hub_id("runs/tiny-modle")      # runs/ exists: a mistyped local path
    for path in ("./Qwen/Qwen2.5", "/models/qwen", "~/qwen/x", "../a/b", "a/b/c", "Qwen", "a/../b", "", None):
        assert not is_hub_id(path), path

    # the start-up check: a mistyped local path is "not a directory", never looked up on the Hub
    from megarl.commands.startup import check_model
    from megarl.config import ConfigError, TrainConfig

    cfg = TrainConfig()
    cfg.model.path = "runs/tiny-modle"
    with pytest.raises(ConfigError, match=r"^model.path: runs/tiny-modle is not a directory \(an HF or megarl"):
        check_model(cfg)


def test_offline_cache_resolves_and_loads(hub_cache, tiny_ckpt, megatron_world):
    """Acceptance (Offline Hub): with HF_HUB_OFFLINE=1 a Hub id resolves, through the function
    the trainer uses, to the cached snapshot, which megarl's loaders read exactly like the
    original directory; an uncached id fails with one line naming key, id and the fix."""
    import torch
    from huggingface_hub import scan_cache_dir

    from megarl.config import TrainConfig
    from megarl.models.hf_config import load_spec
    from megarl.models.megatron_ckpt import load_model

    # huggingface_hub itself reads the prepared layout as a cache with both commits
    [repo] = scan_cache_dir(hub_cache).repos
    assert repo.repo_id == REPO and {r.commit_hash for r in repo.revisions} == {COMMIT_A, COMMIT_B}

    cfg = TrainConfig()
    cfg.model.path, cfg.model.tokenizer = REPO, f"{REPO}@{COMMIT_B}"
    cfg.reference.path = REPO
    sources = resolve_sources(cfg)
    snap_a = os.path.join(hub_cache, "models--megarl-test--tiny-llama", "snapshots", COMMIT_A)
    assert os.path.samefile(cfg.model.path, snap_a) and os.path.samefile(cfg.reference.path, snap_a)
    assert cfg.model.tokenizer.endswith(os.path.join("snapshots", COMMIT_B))
    assert sources["model.path"] == {"hub_id": REPO, "revision": None, "commit": COMMIT_A, "path": cfg.model.path}
    assert sources["model.tokenizer"]["commit"] == COMMIT_B and sources["model.tokenizer"]["revision"] == COMMIT_B
    assert resolve_sources(cfg) == {}  # resolved paths are local directories now

    assert load_spec(cfg.model.path) == load_spec(tiny_ckpt)
    assert TokenizerContract.from_pretrained(cfg.model.tokenizer).hash == TokenizerContract.from_pretrained(tiny_ckpt).hash
    got, want = load_model(cfg.model.path).state_dict(), load_model(tiny_ckpt).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want if torch.is_tensor(want[k]))

    with pytest.raises(HubSourceError) as e:
        resolve_source("reward.model.path", "megarl-test/not-cached")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("reward.model.path: megarl-test/not-cached is not in the local Hub cache")
    assert "HF_HUB_OFFLINE=1" in msg and "`hf download megarl-test/not-cached`" in msg
    with pytest.raises(HubSourceError, match=f"model.path: {REPO}@{'c' * 40} is not in the local Hub cache"):
        resolve_source("model.path", REPO, revision="c" * 40)
    with pytest.raises(HubSourceError, match="pins revision 'v1' but model.revision is 'v2'"):
        resolve_source("model.path", f"{REPO}@v1", revision="v2")


def test_local_ranks_load_local_rank_0s_commit(hub_cache):
    """Local rank 0 resolves and hands its commit on: a rank that resolves after the branch
    moved still loads the commit rank 0 got; a failure on rank 0 is every rank's failure."""
    from megarl.config import TrainConfig

    def cfg_for(path):
        cfg = TrainConfig()
        cfg.model.path = path
        return cfg

    rank0 = cfg_for(REPO)
    assert resolve_sources(rank0, local_rank=0, local_world=2)["model.path"]["commit"] == COMMIT_A
    with open(os.path.join(hub_cache, "models--megarl-test--tiny-llama", "refs", "main"), "w") as f:
        f.write(COMMIT_B)  # main moves between local rank 0's resolution and local rank 1's
    rank1 = cfg_for(REPO)
    assert resolve_sources(rank1, local_rank=1, local_world=2, timeout_s=5)["model.path"]["commit"] == COMMIT_A
    assert rank1.model.path == rank0.model.path
    assert resolve_sources(cfg_for(REPO), local_rank=0, local_world=1)["model.path"]["commit"] == COMMIT_B

    with pytest.raises(HubSourceError) as e0:
        resolve_sources(cfg_for("megarl-test/absent"), local_rank=0, local_world=2)
    with pytest.raises(HubSourceError) as e1:
        resolve_sources(cfg_for("megarl-test/absent"), local_rank=1, local_world=2, timeout_s=5)
    assert str(e1.value) == str(e0.value)


# ---- prompt rows from `datasets` directories and directories of files ---------------------------------

ROWS = [
    {"id": "q1", "prompt": "what is 1 plus 2 ?", "answer": "3"},
    {"prompt": "what is 12 plus 7 ?", "answer": "19", "level": 2},
    {"id": "q3", "messages": [{"role": "system", "content": "solve"}, {"role": "user", "content": "what is 3 times 4 ?"}],
     "answer": "12"},
]


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(d)
    return TokenizerContract.from_pretrained(d)


def _dataset(rows):
    """A datasets.Dataset of ``rows`` (a column per key any row has; null where a row lacks it)."""
    import datasets

    keys = sorted({k for r in rows for k in r})
    return datasets.Dataset.from_dict({k: [r.get(k) for r in rows] for k in keys})


def _rows_sha256(rows):
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps(r, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()


def test_datasets_directories_and_file_directories_give_the_rows_of_a_jsonl_file(contract, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _dataset(ROWS).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": _dataset(ROWS), "test": _dataset(ROWS[:1])}
                         ).save_to_disk(str(tmp_path / "dsdict"))
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    pq.write_table(pa.Table.from_pylist(ROWS[2:]), str(files / "b.parquet"))
    (files / "README.md").write_text("not a prompt file")

    want = load_prompt_dataset(jsonl, contract, max_prompt_tokens=64)
    for src, split in ((tmp_path / "ds", None), (tmp_path / "dsdict", "train"), (files, None)):
        got = load_prompt_dataset(src, contract, max_prompt_tokens=64, split=split)
        assert [(r.prompt_ids, r.text, r.messages, dict(r.ground_truth)) for r in got] == \
               [(r.prompt_ids, r.text, r.messages, dict(r.ground_truth)) for r in want], src
        assert [r.prompt_id for r in got][0::2] == ["q1", "q3"]
    assert [w for w, _ in iter_rows(files)] == [f"{files}/a.jsonl:1", f"{files}/a.jsonl:2", f"{files}/b.parquet:1"]
    assert [w for w, _ in iter_rows(tmp_path / "dsdict", split="test")] == [f"{tmp_path}/dsdict[test]#0"]
    assert load_prompt_dataset(tmp_path / "dsdict", contract, max_prompt_tokens=64, split="train")[1].prompt_id == \
        "dsdict/train:1"

    # a datasets source hashes its rows: the same rows saved again (or as a DatasetDict split) hash alike
    ds_stats = load_prompt_dataset(tmp_path / "ds", contract, max_prompt_tokens=64).stats
    assert ds_stats["sha256"] == _rows_sha256(ROWS) and ds_stats["source"] == "datasets"
    _dataset(ROWS).save_to_disk(str(tmp_path / "ds_again"))
    assert load_prompt_dataset(tmp_path / "ds_again", contract, max_prompt_tokens=64).stats["sha256"] == _rows_sha256(ROWS)
    changed = [dict(ROWS[0], answer="4")] + ROWS[1:]
    _dataset(changed).save_to_disk(str(tmp_path / "ds_changed"))
    assert load_prompt_dataset(tmp_path / "ds_changed", contract, max_prompt_tokens=64).stats["sha256"] == \
        _rows_sha256(changed) != _rows_sha256(ROWS)


def test_datasets_source_errors(contract, tmp_path, monkeypatch):
    import datasets

    datasets.DatasetDict({"train": _dataset([{"prompt": "hello", "answer": "1"}, {"answer": "2"}])}
                         ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(PromptDatasetError, match=r"dd: has no split 'validation'; its splits are \['train'\]"):
        load_prompt_dataset(tmp_path / "dd", contract, max_prompt_tokens=64, split="validation")
    with pytest.raises(PromptDatasetError, match=r"dd\[train\]#1: needs a 'prompt' \(text\) or 'messages'"):
        load_prompt_dataset(tmp_path / "dd", contract, max_prompt_tokens=64, split="train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptDatasetError, match="holds no .jsonl, .json, .parquet files"):
        list(iter_rows(tmp_path / "empty"))
    with pytest.raises(PromptDatasetError, match=r"prompt file data/missing\.jsonl does not exist"):
        list(iter_rows("data/missing.jsonl"))  # file-shaped: never read as a Hub dataset
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the extra were not installed
    with pytest.raises(PromptDatasetError, match=r'needs the datasets package: pip install -e "\.\[datasets\]"'):
        list(iter_rows(tmp_path / "dd", split="train"))


# ---- the prep tools, on a few rows in the datasets' own formats, scored by the real reward --------------

# three GSM8K records as they appear in grade-school-math's train.jsonl / test.jsonl
GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
               "in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
               "$<<0.2*50=10>>10.\n#### 10"},
    {"question": "A new program had 60 downloads in the first month. The number of downloads in the second month was "
                 "three times as many as the downloads in the first month, but then reduced by 30% in the third "
                 "month. How many downloads did the program have total over the three months?",
     "answer": "The number of downloads of the program in the second month increased to 3*60 = <<3*60=180>>180\n"
               "In the first two months, the total number of downloads of the program was 180+60 = <<180+60=240>>240\n"
               "In the third month, the number of downloads of the program reduced by 30/100*180 = <<30/100*180=54>>54\n"
               "There were 180-54 = <<180-54=126>>126 downloads in the third month.\n"
               "In the three months, the total number of downloads of the program was 126+240 = <<126+240=366>>366\n"
               "#### 366"},
    {"question": "A shop sold 1200 pens on Monday and the same again on Tuesday. How many pens did it sell?",
     "answer": "It sold 1200+1200 = <<1200+1200=2400>>2400 pens.\n#### 2,400"},  # GSM8K-style thousands separator
]

# MATH problems as in the original release (<split>/<subject>/<n>.json) and in MATH-500's jsonl
MATH_TREE = {
    "algebra/1.json": {"problem": "What is the positive difference between $120\\%$ of 30 and $130\\%$ of 20?",
                       "level": "Level 1", "type": "Algebra",
                       "solution": "One hundred twenty percent of 30 is $120\\cdot30\\cdot\\frac{1}{100}=36$, and "
                                   "$130\\%$ of 20 is $ 130\\cdot 20\\cdot\\frac{1}{100}=26$.  The difference between "
                                   "36 and 26 is $\\boxed{10}$."},
    "algebra/2.json": {"problem": "Evaluate $\\log_2\\sqrt{2}$.", "level": "Level 2", "type": "Algebra",
                       "solution": "We have $\\sqrt{2} = 2^{1/2}$, so $\\log_2\\sqrt{2} = \\log_2 2^{1/2} = "
                                   "\\boxed{\\frac{1}{2}}$."},
    "precalculus/3.json": {"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.  "
                                      "Enter your answer in the form $(r,\\theta),$ where $r > 0$ and "
                                      "$0 \\le \\theta < 2 \\pi.$",
                           "level": "Level 2", "type": "Precalculus",
                           "solution": "We have that $r = \\sqrt{0^2 + 3^2} = 3.$  Also, if we draw the line "
                                       "connecting the origin and $(0,3),$ this line makes an angle of "
                                       "$\\frac{\\pi}{2}$ with the positive $x$-axis.\n\nTherefore, the polar "
                                       "coordinates are $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$"},
}
MATH500 = {"problem": "If $x^2 = 16$ and $x > 0$, what is $x$?", "solution": "Since $x>0$, $x = \\boxed{4}$.",
           "answer": "4", "subject": "Algebra", "level": 1, "unique_id": "test/algebra/9999.json"}


def _tool(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def _math_verify_scores(rows, response):
    """The real math_verify reward's total for ``response(row)`` on every row."""
    from megarl.rewards import build_reward_function
    from megarl.rewards.base import RewardSample

    fn = build_reward_function("math_verify")
    out = []
    for r in rows:
        gt = {k: v for k, v in r.items() if k not in ("id", "prompt", "messages")}
        s = RewardSample(sample_id="s", prompt_id=r["id"], group_id="g", prompt_text=r.get("prompt", ""),
                         response_text=response(r), prompt_ids=(1,), response_ids=(2,), finish_reason="stop",
                         ground_truth=gt)
        rec = fn(s)
        assert rec.status.value == "ok", rec
        out.append(rec.total)
    return out


def test_prep_gsm8k_rows_score_their_gold_answer(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    _tool("prep_gsm8k").main(["--in", str(src), "--out", str(tmp_path / "gsm8k.jsonl")])
    rows = _read_jsonl(tmp_path / "gsm8k.jsonl")
    assert [r["answer"] for r in rows] == ["72", "10", "366", "2400"]
    assert [r["id"] for r in rows] == ["gsm8k-train-0", "gsm8k-train-1", "gsm8k-train-2", "gsm8k-train-3"]
    assert rows[0]["prompt"] == GSM8K[0]["question"] + "\n\nPlease reason step by step, and put your final answer " \
                                                       "within \\boxed{}."
    assert {r["source"] for r in rows} == {"gsm8k"} and "####" not in rows[2]["solution"]
    assert _math_verify_scores(rows, lambda r: f"So the answer is \\boxed{{{r['answer']}}}.") == [1.0] * 4
    assert _math_verify_scores(rows, lambda r: "So the answer is \\boxed{71}.") == [0.0] * 4

    _tool("prep_gsm8k").main(["--in", str(src), "--out", str(tmp_path / "chat.jsonl"), "--chat", "--suffix", "",
                              "--system", "be brief", "--limit", "2"])
    chat = _read_jsonl(tmp_path / "chat.jsonl")
    assert len(chat) == 2 and chat[1]["messages"] == [{"role": "system", "content": "be brief"},
                                                      {"role": "user", "content": GSM8K[1]["question"]}]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GSM8K[0]) + "\n" + json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "prep_gsm8k.py"), "--in", str(bad), "--out",
                        str(tmp_path / "never.jsonl")], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {bad}:2: the answer has no '#### <final answer>' line"
    assert not os.path.exists(tmp_path / "never.jsonl") and not os.path.exists(tmp_path / "never.jsonl.tmp")


def test_prep_math_rows_score_their_gold_answer(tmp_path):
    from megarl.data.tasks.math_answers import last_boxed

    for rel, rec in MATH_TREE.items():
        path = tmp_path / "MATH" / "test" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec))
    (tmp_path / "math500.jsonl").write_text(json.dumps(MATH500) + "\n")
    _tool("prep_math").main(["--in", str(tmp_path / "MATH" / "test"), str(tmp_path / "math500.jsonl"),
                             "--out", str(tmp_path / "math.jsonl")])
    rows = _read_jsonl(tmp_path / "math.jsonl")
    assert [r["id"] for r in rows] == ["math/test/algebra/1", "math/test/algebra/2", "math/test/precalculus/3",
                                       "test/algebra/9999.json"]
    assert [r["answer"] for r in rows] == ["10", "$\\frac{1}{2}$", "$\\left( 3, \\frac{\\pi}{2} \\right)$", "4"]
    assert [(r["level"], r["type"], r["source"]) for r in rows] == [
        (1, "Algebra", "math"), (2, "Algebra", "math"), (2, "Precalculus", "math"), (1, "Algebra", "math")]
    boxed = ["10", "\\frac{1}{2}", "\\left( 3, \\frac{\\pi}{2} \\right)", "4"]  # the solutions' last boxes
    assert _math_verify_scores(rows, lambda r: f"The final answer is $\\boxed{{{boxed[rows.index(r)]}}}$.") == [1.0] * 4
    assert _math_verify_scores(rows, lambda r: "The final answer is $\\boxed{7}$.") == [0.0] * 4
    # equivalent forms count too: the reward, not the prep, decides equality
    assert _math_verify_scores(rows[1:2], lambda r: "$\\boxed{0.5}$") == [1.0]

    _tool("prep_math").main(["--in", str(tmp_path / "MATH" / "test"), "--out", str(tmp_path / "hard.jsonl"),
                             "--levels", "2"])
    assert [r["id"] for r in _read_jsonl(tmp_path / "hard.jsonl")] == ["math/test/algebra/2", "math/test/precalculus/3"]
    # balanced braces, the last box, \fbox and the brace-less form
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("$\\boxed{\\{1,2\\}}$") == "\\{1,2\\}" and last_boxed("\\fbox{x^{2}}") == "x^{2}"
    assert last_boxed("so \\boxed 5.") == "5." and last_boxed("\\boxed{open") is None and last_boxed("none") is None


# ---- the example reward plug-in --------------------------------------------------------------------------


def _sample(response, **ground_truth):
    from megarl.rewards.base import RewardSample

    return RewardSample(sample_id="s0", prompt_id="p0", group_id="g0", prompt_text="what is 2 times 500 ?",
                        response_text=response, prompt_ids=(1, 2), response_ids=(3,), finish_reason="stop",
                        ground_truth=ground_truth)


def test_example_reward_plugin_loads_by_dotted_path_and_scores():
    from megarl.rewards import build_reward_function
    from megarl.rewards.declarations import extract_answer, required_fields

    fn = build_reward_function("examples.reward_plugin:boxed_answer", {"format_weight": 0.25})
    scores = [(r.total, dict(r.components)) for r in (
        fn(_sample("2 x 500 = 1000, so \\boxed{1,000}.", answer="1000")),
        fn(_sample("so \\boxed{999}", answer="1000")),
        fn(_sample("it is 1000", answer="1000")),
        fn(_sample("$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$", answer="$(3,\\frac{\\pi}{2})$")),
    )]
    assert scores == [(1.0, {"format": 1.0, "correct": 1.0}), (0.25, {"format": 1.0, "correct": 0.0}),
                      (0.0, {"format": 0.0, "correct": 0.0}), (1.0, {"format": 1.0, "correct": 1.0})]
    assert fn.version.startswith("user/boxed_answer(examples.reward_plugin:boxed_answer,kwargs=")
    assert required_fields(fn) == ("answer",)  # what the start-up data check reads
    assert extract_answer(fn, "first \\boxed{2} then \\boxed{ 12 }") == "12"
    with pytest.raises(ValueError, match="ground_truth\\['answer'\\]"):
        fn(_sample("\\boxed{1}", target="1"))  # a row without the field: the runner counts an error, not a 0


def test_cli_hub_id_dataset_dir_and_plugin_end_to_end(tmp_path, tiny_ckpt):
    """`--dry-run` and a one-iteration run of the tiny recipe with model.path a Hub id from an
    offline cache, the train split a `datasets` directory and the example plug-in as reward:
    the run loads the snapshot and records id and commit in run.json; an uncached id is one
    error line, exit 2, before any model loads."""
    import datasets  # noqa: F401  (the `datasets` extra)

    cache = str(tmp_path / "hub")
    add_to_hub_cache(cache, REPO, tiny_ckpt, COMMIT_A)
    rows = [{"id": f"p{i}", "prompt": f"what is {i} plus {i} ?", "answer": str(2 * i)} for i in range(8)]
    _dataset(rows).save_to_disk(str(tmp_path / "train_ds"))
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    env = dict(subprocess_env(), HF_HUB_OFFLINE="1", HF_HUB_CACHE=cache)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    run_dir = str(tmp_path / "run")
    recipe = ["--config", os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")]
    common = ["model.build_tiny=false",
              "data.task.build=false", f"data.train_path={tmp_path / 'train_ds'}",
              f"data.heldout_path={tmp_path / 'heldout.jsonl'}", "reward.fn=examples.reward_plugin:boxed_answer",
              "trainer.iterations=1", "trainer.prompts_per_iteration=2", "rollout.n=2", "eval.n=4",
              f"trainer.run_dir={run_dir}"]

    def train(*args):
        return subprocess.run([sys.executable, "-m", "megarl.train", *recipe, *args], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=600)

    snapshot = os.path.join(cache, "models--megarl-test--tiny-llama", "snapshots", COMMIT_A)
    dry = train("--dry-run", f"model.path={REPO}", *common)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert f"ok   model.path: {snapshot}: LlamaForCausalLM" in dry.stdout
    assert f"ok   data.train_path: {tmp_path / 'train_ds'}: 8 of 8 rows kept" in dry.stdout

    bad = train("--dry-run", "model.path=megarl-test/not-cached", *common)
    err = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 2 and len(err) == 1, bad.stderr[-3000:]
    assert err[0].startswith("error: model.path: megarl-test/not-cached is not in the local Hub cache"), err

    run = train(f"model.path={REPO}", *common)
    assert run.returncode == 0, run.stderr[-3000:]
    info = json.load(open(os.path.join(run_dir, "run.json")))
    assert info["sources"] == {"model.path": {"hub_id": REPO, "revision": None, "commit": COMMIT_A, "path": snapshot}}
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    # the plug-in scored every sample (in a reward worker process: examples/ imports there too)
    assert metrics[0]["reward/boxed_answer/errors"] == 0 and metrics[0]["eval/scored"] == 4


def test_hub_dataset_names_offline_and_not_cached(monkeypatch):
    """A Hub dataset name goes to datasets.load_dataset; offline and not cached it is one line."""
    import datasets.config
    import huggingface_hub.constants

    from megarl.data.prompts import source_kind

    assert source_kind("hf://datasets/gsm8k") == source_kind("megarl-test/no-such-dataset") == "hub"
    # what HF_HUB_OFFLINE=1 in the environment sets when the libraries are imported
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PromptDatasetError) as e:
        list(iter_rows("megarl-test/no-such-dataset", split="train", subset="main"))
    assert str(e.value) == ("hf://datasets/megarl-test/no-such-dataset: not in the local datasets cache, and "
                            "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set; load it once online, or save it with "
                            "Dataset.save_to_disk and give that directory")

"""Prompt datasets (JSONL / Parquet through the tokenizer contract) and the resumable sampler."""

import hashlib
import json

import pytest

from megarl.data.prompts import (
    PromptDatasetError,
    PromptRecord,
    PromptSampler,
    load_prompt_dataset,
)
from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
from megarl.data.tokenizer import TokenizerContract
from megarl.errors import MegarlError


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(d)
    return TokenizerContract.from_pretrained(d)


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_text_prompts_through_chat_template(contract, tmp_path):
    p = _jsonl(tmp_path / "a.jsonl", [
        {"id": "q1", "prompt": "what is 1 plus 2 ?", "answer": "3"},
        {"prompt": "what is 12 plus 7 ?", "answer": "19", "level": 2},
    ])
    ds = load_prompt_dataset(p, contract, max_prompt_tokens=64)
    assert len(ds) == 2
    r0, r1 = ds.records
    assert isinstance(r0, PromptRecord)
    assert r0.prompt_id == "q1" and r1.prompt_id == "a.jsonl:2"
    assert r0.prompt_ids == tuple(contract.encode_prompt([{"role": "user", "content": "what is 1 plus 2 ?"}]))
    assert r0.text == "what is 1 plus 2 ?"
    assert r0.messages == ({"role": "user", "content": "what is 1 plus 2 ?"},)
    assert r0.ground_truth == {"answer": "3"} and r1.ground_truth == {"answer": "19", "level": 2}
    assert ds.stats == {"rows": 2, "kept": 2, "dropped_overlong": 0, "max_prompt_tokens_seen": len(r1.prompt_ids),
                        "path": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}

    raw = load_prompt_dataset(p, contract, apply_chat_template=False, max_prompt_tokens=64)
    assert raw[0].prompt_ids == tuple(contract.encode_prompt("what is 1 plus 2 ?")) and raw[0].messages is None

    sys_ds = load_prompt_dataset(p, contract, system_prompt="think step by step", max_prompt_tokens=64)
    want = [{"role": "system", "content": "think step by step"}, {"role": "user", "content": "what is 1 plus 2 ?"}]
    assert sys_ds[0].prompt_ids == tuple(contract.encode_prompt(want)) and list(sys_ds[0].messages) == want


def test_messages_rows_and_custom_fields(contract, tmp_path):
    chat = [{"role": "system", "content": "solve"}, {"role": "user", "content": "what is 3 times 4 ?"}]
    p = _jsonl(tmp_path / "chat.json", [{"uid": 7, "conv": chat, "answer": "12"}, "", {"uid": "x", "question": "hello", "answer": "1"}])
    ds = load_prompt_dataset(p, contract, prompt_field="question", messages_field="conv", id_field="uid",
                             system_prompt="ignored: chat has a system turn", max_prompt_tokens=64)
    assert [r.prompt_id for r in ds] == ["7", "x"]
    assert ds[0].prompt_ids == tuple(contract.encode_prompt(chat)) and ds[0].text is None
    assert list(ds[0].messages) == chat and ds[0].ground_truth == {"answer": "12"}
    assert ds.stats["rows"] == 2  # the blank line is skipped
    with pytest.raises(PromptDatasetError, match=r"chat\.json:1.*'conv'.*apply_chat_template"):
        load_prompt_dataset(p, contract, prompt_field="question", messages_field="conv", id_field="uid",
                            apply_chat_template=False, max_prompt_tokens=64)


def test_parquet_round_trip(contract, tmp_path):
    import pyarrow as pa  # a declared dependency: a missing one must fail, not skip
    import pyarrow.parquet as pq
    rows = [{"id": "p0", "prompt": "what is 5 minus 2 ?", "messages": None, "answer": "3"},
            {"id": "p1", "prompt": None, "messages": [{"role": "user", "content": "hello world"}], "answer": "0"}]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = load_prompt_dataset(path, contract, max_prompt_tokens=64)
    j = load_prompt_dataset(_jsonl(tmp_path / "d.jsonl", [
        {"id": "p0", "prompt": "what is 5 minus 2 ?", "answer": "3"},
        {"id": "p1", "messages": [{"role": "user", "content": "hello world"}], "answer": "0"}]), contract,
        max_prompt_tokens=64)
    assert ds.records == j.records
    assert ds.stats["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(PromptDatasetError, match=r"d\.parquet:2.*'prompt'.*'messages'"):
        pq.write_table(pa.Table.from_pylist([rows[0], {**rows[1], "id": "p2", "messages": None}]), path)
        load_prompt_dataset(path, contract, max_prompt_tokens=64)


def test_parquet_without_pyarrow_says_how_to_install(contract, tmp_path, monkeypatch):
    import sys

    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(PromptDatasetError, match="pip install pyarrow"):
        load_prompt_dataset(path, contract, max_prompt_tokens=64)


def test_overlong_dropped_and_counted(contract, tmp_path):
    short, long_ = "what is 1 plus 1 ?", "what is " + " plus ".join(["1 2 3"] * 10) + " ?"
    p = _jsonl(tmp_path / "o.jsonl", [{"prompt": short}, {"prompt": long_}, {"prompt": short + " "}])
    n_short = len(contract.encode_prompt([{"role": "user", "content": short}]))
    n_long = len(contract.encode_prompt([{"role": "user", "content": long_}]))
    ds = load_prompt_dataset(p, contract, max_prompt_tokens=n_short)
    assert [r.prompt_id for r in ds] == ["o.jsonl:1", "o.jsonl:3"]
    assert all(len(r.prompt_ids) <= n_short for r in ds)
    assert (ds.stats["rows"], ds.stats["kept"], ds.stats["dropped_overlong"]) == (3, 2, 1)
    assert ds.stats["max_prompt_tokens_seen"] == n_long
    with pytest.raises(PromptDatasetError, match="all 3 prompts are longer than max_prompt_tokens=3"):
        load_prompt_dataset(p, contract, max_prompt_tokens=3)


@pytest.mark.parametrize("bad,match", [
    ('{"prompt": "ok"', r"bad\.jsonl:2: not valid JSON"),
    ('["a"]', r"bad\.jsonl:2: expected a JSON object"),
    ('{"answer": "1"}', r"bad\.jsonl:2: needs a 'prompt' .* or 'messages'"),
    ('{"prompt": 5}', r"bad\.jsonl:2: field 'prompt' must be a non-empty string"),
    ('{"prompt": "x", "messages": [{"role": "user", "content": "x"}]}', r"bad\.jsonl:2: has both"),
    ('{"messages": "hi"}', r"bad\.jsonl:2: field 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', r"bad\.jsonl:2: field 'messages' message 0 needs a string 'content'"),
    ('{"id": [1], "prompt": "x"}', r"bad\.jsonl:2: field 'id' must be a string or an integer"),
])
def test_bad_rows_named_by_line(contract, tmp_path, bad, match):
    p = _jsonl(tmp_path / "bad.jsonl", ['{"prompt": "hello"}', bad, '{"prompt": "world"}'])
    with pytest.raises(PromptDatasetError, match=match) as e:
        load_prompt_dataset(p, contract, max_prompt_tokens=64)
    assert isinstance(e.value, MegarlError) and isinstance(e.value, ValueError)


def test_file_level_errors(contract, tmp_path):
    with pytest.raises(PromptDatasetError, match=r"nope\.jsonl does not exist"):
        load_prompt_dataset(tmp_path / "nope.jsonl", contract, max_prompt_tokens=64)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(PromptDatasetError, match=r"empty\.jsonl has no rows"):
        load_prompt_dataset(tmp_path / "empty.jsonl", contract, max_prompt_tokens=64)
    (tmp_path / "x.csv").write_text("prompt\nhi\n")
    with pytest.raises(PromptDatasetError, match=r"x\.csv: unknown format"):
        load_prompt_dataset(tmp_path / "x.csv", contract, max_prompt_tokens=64)
    (tmp_path / "arr.json").write_text('[\n{"prompt": "hi"}\n]\n')
    with pytest.raises(PromptDatasetError, match=r"arr\.json:1: .*not a JSON array"):
        load_prompt_dataset(tmp_path / "arr.json", contract, max_prompt_tokens=64)
    ok = _jsonl(tmp_path / "ok.jsonl", [{"prompt": "hi"}])
    with pytest.raises(PromptDatasetError, match="max_prompt_tokens"):
        load_prompt_dataset(ok, contract, max_prompt_tokens=0)
    with pytest.raises(PromptDatasetError, match="system_prompt needs apply_chat_template"):
        load_prompt_dataset(ok, contract, apply_chat_template=False, system_prompt="s", max_prompt_tokens=64)
    bare = TokenizerContract(contract.tokenizer, None, "sha256:" + "0" * 64)
    with pytest.raises(PromptDatasetError, match="no chat template"):
        load_prompt_dataset(ok, bare, max_prompt_tokens=64)
    assert len(load_prompt_dataset(ok, bare, apply_chat_template=False, max_prompt_tokens=64)) == 1


def test_duplicate_ids_name_both_lines(contract, tmp_path):
    p = _jsonl(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}])
    with pytest.raises(PromptDatasetError, match=r"dup\.jsonl:3: duplicate 'id' 'a' \(first at .*dup\.jsonl:1\)"):
        load_prompt_dataset(p, contract, max_prompt_tokens=64)
    q = _jsonl(tmp_path / "dupint.jsonl", [{"id": 1, "prompt": "x"}, {"id": "1", "prompt": "y"}])
    with pytest.raises(PromptDatasetError, match=r"dupint\.jsonl:2: duplicate"):
        load_prompt_dataset(q, contract, max_prompt_tokens=64)


# ---- sampler ---------------------------------------------------------------------------------


def test_sampler_each_index_once_per_epoch():
    n = 13
    s = PromptSampler(n, seed=3)
    draws = s.next_indices(5 * n)
    epochs = [draws[i * n:(i + 1) * n] for i in range(5)]
    for e, ep in enumerate(epochs):
        assert sorted(ep) == list(range(n))
        assert ep == s.epoch_order(e)
    assert len({tuple(ep) for ep in epochs}) > 1  # reshuffled per epoch
    assert s.state_dict() == {"seed": 3, "epoch": 5, "cursor": 0, "shuffle": True, "dataset_len": n}
    assert PromptSampler(n, seed=3, shuffle=False).next_indices(n + 2) == list(range(n)) + [0, 1]
    assert PromptSampler(n, seed=4).next_indices(n) != epochs[0]


def test_sampler_determinism_independent_of_call_sizes():
    a, b = PromptSampler(10, seed=0), PromptSampler(10, seed=0)
    big = a.next_indices(37)
    small = []
    for k in (1, 0, 9, 4, 11, 2, 10):
        small += b.next_indices(k)
    assert small == big and a.state_dict() == b.state_dict()
    it = iter(PromptSampler(10, seed=0))
    assert [next(it) for _ in range(37)] == big


def test_sampler_resume_draws_the_same_next_prompts():
    orig = PromptSampler(11, seed=1234)
    for k in (3, 5, 1, 11, 0, 7, 2):  # 7 advances, crossing epoch boundaries
        orig.next_indices(k)
    state = json.loads(json.dumps(orig.state_dict()))  # survives a JSON checkpoint
    resumed = PromptSampler(11, seed=1234)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == orig.state_dict()
    for k in (4, 13, 1, 30):
        assert resumed.next_indices(k) == orig.next_indices(k)


def test_sampler_refuses_foreign_state():
    state = PromptSampler(11, seed=1).state_dict()
    with pytest.raises(PromptDatasetError, match="dataset of 11 prompts, this one has 12"):
        PromptSampler(12, seed=1).load_state_dict(state)
    with pytest.raises(PromptDatasetError, match="seed 1, this run uses seed 2"):
        PromptSampler(11, seed=2).load_state_dict(state)
    with pytest.raises(PromptDatasetError, match="shuffle"):
        PromptSampler(11, seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(PromptDatasetError, match="missing"):
        PromptSampler(11, seed=1).load_state_dict({"seed": 1})
    with pytest.raises(ValueError):
        PromptSampler(0, seed=1)
    with pytest.raises(ValueError):
        PromptSampler(3, seed=-1)

"""`collab export` (collab_app/online/export.py): every format loads back with the stored values exact."""
from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import pytest

from collab_app.engines.engine_types import Sample
from collab_app.online.export import ARENA_SCHEMA, FORMATS, SCHEMA, cli_main, export
from collab_app.online.returns import ReturnRule, scale_rating
from collab_app.online.store import Store
from tasks.base import Reward


def _samples(rng, G=2):
    return [[Sample(agent=a, adapter_version=rng.choice([None, 1, 2]),
                    prompt_token_ids=[rng.randrange(50_000) for _ in range(5)], text=f"{a} text {g} ✓",
                    token_ids=[rng.randrange(200_000) for _ in range(6)],
                    logprobs=[-rng.random() * 10 ** rng.randint(-30, 1) for _ in range(6)], finish_reason="stop")
             for g in range(G)] for a in ("first", "second")]


@pytest.fixture
def filled(tmp_path):
    """A store with a coding group (rated, re-rated), a writing group (other level names) and a
    human-only group nobody rated."""
    st = Store(f"sqlite:///{tmp_path / 'c.db'}")
    rng = random.Random(5)
    code = st.add_group("humaneval", {"id": "HumanEval/0"}, ["p1", "p2"], _samples(rng), [(0, 0), (1, 1)],
                        [Reward(1.0, {"structure": 1.0, "tests": 0.0}, 4.0, {"err": "boom"}),
                         Reward(2.5, {"structure": 1.0, "tests": 1.5}, 4.0)],
                        combined=["c0", "c1"], session_id="s1")
    st.add_rating(code[1][0], "ann", 1)
    st.add_rating(code[1][0], "ann", 5, "re-rated")
    st.add_rating(code[1][0], "bob", 3)
    write = st.add_group("tldr", {"id": "t1", "text": "long text"}, ["w1", "w2"], _samples(rng, G=3),
                         [(0, 0), (1, 1), (2, 2)],
                         [Reward(0.5, {"length": 0.5, "ratio": 0.0}, 3.0) for _ in range(3)], turn=1)
    human = st.add_group("expansion", {"id": "x"}, ["a", "b"], _samples(rng), [(0, 1), (1, 0)], [None, None],
                         max_reward=3.0, auto_errors=["sandbox crashed", None])
    yield st, code, write, human
    st.close()


def _check_rows(rows: list[dict], st: Store, code, write, human):
    assert len(rows) == 2 + 3 + 2
    by_jid = {r["joint_sample_id"]: r for r in rows}
    for gid, jids in (code, write, human):
        g = st.group(gid)
        for j in g.joints:
            r = by_jid[j.id]
            parts = [g.samples[i][gi] for i, gi in enumerate(j.joint)]
            assert r["group_id"] == gid and r["joint"] == list(j.joint) and r["task"] == g.task
            assert r["token_ids"] == [s.token_ids for s in parts]          # exact
            assert r["logprobs"] == [s.logprobs for s in parts]            # exact doubles
            assert r["prompt_token_ids"] == [s.prompt_token_ids for s in parts]
            assert r["adapter_versions"] == [s.adapter_version for s in parts]
            assert r["texts"] == [s.text for s in parts] and r["agents"] == ["first", "second"]
            assert json.loads(r["example"]) == g.example
    c0 = by_jid[code[1][0]]
    assert json.loads(c0["auto_levels"]) == {"structure": 1.0, "tests": 0.0}
    assert json.loads(c0["auto_details"]) == {"err": "boom"} and c0["combined"] == "c0"
    assert [(x["rater"], x["value"], x["comment"]) for x in c0["ratings"]] == \
        [("ann", 5.0, "re-rated"), ("bob", 3.0, "")]                 # re-rating replaced ann's 1
    assert [(x["revision"], x["late"]) for x in c0["ratings"]] == [(1, False), (0, False)]
    assert {x["kind"] for x in c0["ratings"]} == {"stars"}      # the feedback form travels with the rating
    assert c0["human_score"] == scale_rating(4.0, 4.0)        # ann's latest 5 and bob's 3
    c1 = by_jid[code[1][1]]   # unrated and the group is young: human_first still waits for a rating,
    assert c1["human_score"] is None and c1["auto_total"] == 2.5   # so the group has no returns yet
    assert c0["return"] is None and c1["return"] is None
    h = by_jid[human[1][0]]
    assert h["auto_total"] is None and h["auto_error"] == "sandbox crashed" and h["return"] is None
    assert by_jid[write[1][2]]["turn"] == 1 and json.loads(by_jid[write[1][2]]["auto_levels"]) == \
        {"length": 0.5, "ratio": 0.0}


def test_export_all_formats_load_back(filled, tmp_path):
    import datasets

    st, code, write, human = filled
    paths = export(st, str(tmp_path / "out"), FORMATS, ReturnRule(mode="human_first", human_timeout_s=3600))
    assert set(paths) == {"jsonl", "datasets", "parquet", "meta", "arena_jsonl", "arena_datasets", "arena_parquet"}
    with open(paths["jsonl"]) as f:
        _check_rows([json.loads(line) for line in f], st, code, write, human)
    table = pq.read_table(paths["parquet"])
    assert table.schema.equals(SCHEMA)
    _check_rows(table.to_pylist(), st, code, write, human)
    ds = datasets.load_from_disk(paths["datasets"])
    assert ds.column_names == SCHEMA.names
    _check_rows(ds.to_list(), st, code, write, human)
    meta = json.load(open(paths["meta"]))
    assert meta["rows"] == 7 and meta["rule"]["mode"] == "human_first" and meta["arena_rows"] == 0
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".export-")]   # temp cleaned


def test_export_auto_rule_and_overwrite(filled, tmp_path):
    st, code, *_ = filled
    out = str(tmp_path / "out")
    export(st, out, ["datasets"])
    paths = export(st, out, ["jsonl", "datasets"], ReturnRule(mode="auto"))   # replaces the earlier one
    rows = [json.loads(line) for line in open(paths["jsonl"])]
    assert {r["joint_sample_id"]: r["return"] for r in rows if r["group_id"] == code[0]} == \
        {code[1][0]: 1.0, code[1][1]: 2.5}
    import datasets
    assert len(datasets.load_from_disk(paths["datasets"])) == 7
    paths = export(st, out, ["parquet"], ReturnRule(mode="human_first", human_timeout_s=0))
    rows = pq.read_table(paths["parquet"]).to_pylist()
    assert {r["joint_sample_id"]: (r["return"], r["return_source"]) for r in rows if r["group_id"] == code[0]} \
        == {code[1][0]: (3.0, "human"), code[1][1]: (2.5, "auto")}   # human where rated, auto otherwise


def test_export_empty_store_and_bad_format(tmp_path):
    st = Store(f"sqlite:///{tmp_path / 'e.db'}")
    paths = export(st, str(tmp_path / "o"), FORMATS)
    assert pq.read_table(paths["parquet"]).num_rows == 0 and open(paths["jsonl"]).read() == ""
    with pytest.raises(ValueError, match="csv"):
        export(st, str(tmp_path / "o"), ["csv"])


def test_cli(filled, tmp_path, capsys):
    st, *_ = filled
    out = tmp_path / "cli"
    assert cli_main(["--out", str(out), "--db", st.url, "--format", "jsonl", "parquet", "--mode", "auto"]) == 0
    assert "exported 7 joint samples" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["arena_votes.jsonl", "arena_votes.parquet", "joint_samples.jsonl",
                                                     "joint_samples.parquet", "meta.json"]
    with pytest.raises(SystemExit):
        cli_main(["--db", st.url])                        # --out is required
    assert "--out DIR is required" in capsys.readouterr().err
    assert cli_main(["--out", str(out), "--db", st.url, "--human-weight", "2"]) == 2


def test_arena_pairs_export_beside_the_ratings(tmp_path):
    """Votes are data: every pair shown, with both states' versions, the prompt, the texts, the vote
    and the voter, in every format; an unvoted pair has winner None."""
    import datasets

    st = Store(f"sqlite:///{tmp_path / 'a.db'}")
    voted = st.add_arena_match("tldr", {"id": "t1", "text": "long ✓ text"}, ["p1", "p2"], "base", "detail:v2,summary:v2",
                               {"summary": None, "detail": None}, {"summary": 2, "detail": 2}, ["a1", "a2"], ["b1", "b2"],
                               combined_a="A", combined_b="B", sampling={"temperature": 0.8}, session_id="web:s")
    st.add_arena_vote(voted, "b", "hf:ann", session_id="web:s", network="10.0.0.0/24", signed_in=True)
    open_ = st.add_arena_match("tldr", {"id": "t2"}, ["q1", "q2"], "base", "detail:v1,summary:v1",
                               {"summary": None, "detail": None}, {"summary": 1, "detail": 1}, ["x", "y"], ["z", "w"])
    paths = export(st, str(tmp_path / "out"), FORMATS)
    rows = [json.loads(line) for line in open(paths["arena_jsonl"])]
    assert pq.read_table(paths["arena_parquet"]).schema.equals(ARENA_SCHEMA)
    for got in (rows, pq.read_table(paths["arena_parquet"]).to_pylist(), datasets.load_from_disk(paths["arena_datasets"]).to_list()):
        by_id = {r["match_id"]: r for r in got}
        assert set(by_id) == {voted, open_}
        v = by_id[voted]
        assert (v["winner"], v["voter"], v["signed_in"], v["network"]) == ("b", "hf:ann", True, "10.0.0.0/24")
        assert json.loads(v["versions_b"]) == {"summary": 2, "detail": 2} and v["state_a"] == "base"
        assert v["prompts"] == ["p1", "p2"] and v["outputs_b"] == ["b1", "b2"] and json.loads(v["example"])["text"] == "long ✓ text"
        assert by_id[open_]["winner"] is None and by_id[open_]["voted_at"] is None
    assert json.load(open(paths["meta"]))["arena_rows"] == 2

"""`collab export`: everything collected, one row per joint sample, as JSONL, a Hugging Face
`datasets` folder (Dataset.save_to_disk) and Parquet.

A row holds the group (task, example, turn, prompts, session, status and why it was expired or
set aside), the joint action (per-agent texts, prompt/generated token ids, behaviour log-probs,
adapter versions, the sampling settings, the base model each part ran on: a heterogeneous team's agents have different bases and tokenizers), the automatic reward
and its levels, every rating (one per rater, oldest first: its `revision` says how often its rater
replaced it, `late` that it came after the group was trained / expired / set aside and so never
trained it), the human score and the return assembled under a `ReturnRule` (None when the group is
not ready under it, or for a candidate without a return in a group that trains on the others).

All formats share one column set. Free-form dicts whose keys differ between tasks (`example`,
`auto_levels`, `auto_details`) are JSON strings in every format, so a Parquet file or a dataset
holding several tasks has one schema. Rows are streamed (groups read in batches, written batch by
batch); each output is written under a temporary name and renamed, so a crashed export leaves no
half file under the final name.

The arena's pairs go beside them (`arena_votes.jsonl`, `arena_votes.parquet`, an `arena_votes`
dataset; keys `arena_<format>` of the result): one row per pair shown, with both team states (key and
adapter version per agent), the prompt, both sides' texts, the vote (None: not voted) and the voter.

Left out: exporting adapter weights (they live in their own directories) and incremental exports.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from collab_app.online.returns import ReturnRule, group_returns, human_score
from collab_app.online.store import ArenaMatchRecord, GroupRecord, Store

FORMATS = ("jsonl", "datasets", "parquet")
FILE_NAMES = {"jsonl": "joint_samples.jsonl", "parquet": "joint_samples.parquet", "datasets": "dataset"}

RATING = pa.struct([("id", pa.int64()), ("rater", pa.string()), ("value", pa.float64()),
                    ("comment", pa.string()), ("created_at", pa.string()),
                    ("kind", pa.string()), ("detail", pa.string()), ("session_id", pa.string()),
                    ("revision", pa.int64()), ("late", pa.bool_())])
SCHEMA = pa.schema([
    ("group_id", pa.int64()), ("task", pa.string()), ("example_id", pa.string()), ("example", pa.string()),
    ("turn", pa.int64()), ("prompts", pa.list_(pa.string())), ("session_id", pa.string()),
    ("group_status", pa.string()), ("group_status_reason", pa.string()), ("trained_step", pa.int64()),
    ("group_created_at", pa.string()),
    ("max_reward", pa.float64()), ("num_agents", pa.int64()), ("num_generations", pa.int64()),
    ("joint_sample_id", pa.int64()), ("joint_index", pa.int64()), ("joint", pa.list_(pa.int64())),
    ("agents", pa.list_(pa.string())), ("texts", pa.list_(pa.string())),
    ("prompt_token_ids", pa.list_(pa.list_(pa.int64()))), ("token_ids", pa.list_(pa.list_(pa.int64()))),
    ("logprobs", pa.list_(pa.list_(pa.float64()))), ("adapter_versions", pa.list_(pa.int64())),
    ("base_models", pa.list_(pa.string())), ("sampling", pa.list_(pa.string())),
    ("finish_reasons", pa.list_(pa.string())), ("combined", pa.string()),
    ("auto_total", pa.float64()), ("auto_max", pa.float64()), ("auto_levels", pa.string()),
    ("auto_details", pa.string()), ("auto_error", pa.string()), ("ratings", pa.list_(RATING)),
    ("human_score", pa.float64()), ("return", pa.float64()), ("return_source", pa.string()),
])

ARENA_FILE_NAMES = {"jsonl": "arena_votes.jsonl", "parquet": "arena_votes.parquet", "datasets": "arena_votes"}
ARENA_SCHEMA = pa.schema([
    ("match_id", pa.int64()), ("task", pa.string()), ("example_id", pa.string()), ("example", pa.string()),
    ("prompts", pa.list_(pa.string())), ("state_a", pa.string()), ("state_b", pa.string()),
    ("versions_a", pa.string()), ("versions_b", pa.string()),
    ("outputs_a", pa.list_(pa.string())), ("outputs_b", pa.list_(pa.string())),
    ("combined_a", pa.string()), ("combined_b", pa.string()), ("sampling", pa.string()),
    ("created_at", pa.string()), ("session_id", pa.string()), ("winner", pa.string()), ("voter", pa.string()),
    ("voted_at", pa.string()), ("network", pa.string()), ("signed_in", pa.bool_()),
])


def arena_row(m: ArenaMatchRecord) -> dict:
    """The export row of one arena pair (versions and sampling as JSON strings: their keys differ per task)."""
    return {"match_id": m.id, "task": m.task, "example_id": m.example_id, "example": _json(m.example),
            "prompts": list(m.prompts), "state_a": m.state_a, "state_b": m.state_b,
            "versions_a": _json(m.versions_a), "versions_b": _json(m.versions_b),
            "outputs_a": list(m.outputs_a), "outputs_b": list(m.outputs_b),
            "combined_a": m.combined_a, "combined_b": m.combined_b, "sampling": _json(m.sampling),
            "created_at": m.created_at.isoformat(), "session_id": m.session_id, "winner": m.winner,
            "voter": m.voter, "voted_at": None if m.voted_at is None else m.voted_at.isoformat(),
            "network": m.network, "signed_in": m.signed_in}


def _write_arena(store: Store, tmp: str, formats: Sequence[str]) -> int:
    """The arena's pairs into `tmp` in `formats` (one table: pairs are few next to samples)."""
    rows = [arena_row(m) for m in store.arena_matches(voted=None)]
    if "jsonl" in formats:
        with open(os.path.join(tmp, ARENA_FILE_NAMES["jsonl"]), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    table = pa.Table.from_pylist(rows, schema=ARENA_SCHEMA)
    if "parquet" in formats:
        pq.write_table(table, os.path.join(tmp, ARENA_FILE_NAMES["parquet"]))
    if "datasets" in formats:
        import datasets
        datasets.Dataset(table).save_to_disk(os.path.join(tmp, ARENA_FILE_NAMES["datasets"]))
    return len(rows)


def _json(x) -> str | None:
    return None if x is None else json.dumps(x, ensure_ascii=False, sort_keys=True)


def group_rows(g: GroupRecord, rule: ReturnRule, now: datetime) -> list[dict]:
    """The export rows (one per joint sample) of one group."""
    ratings = [[(r.rater, r.value) for r in j.ratings] for j in g.joints]
    got = group_returns(rule, [j.auto_total for j in g.joints], ratings, g.max_reward,
                        (now - g.created_at).total_seconds())
    rows = []
    for k, j in enumerate(g.joints):
        parts = [g.samples[i][gi] for i, gi in enumerate(j.joint)]
        rows.append({
            "group_id": g.id, "task": g.task, "example_id": g.example_id, "example": _json(g.example),
            "turn": g.turn, "prompts": list(g.prompts), "session_id": g.session_id, "group_status": g.status,
            "group_status_reason": g.status_reason, "trained_step": g.trained_step, "group_created_at": g.created_at.isoformat(),
            "max_reward": g.max_reward, "num_agents": g.num_agents, "num_generations": g.num_generations,
            "joint_sample_id": j.id, "joint_index": j.joint_index, "joint": list(j.joint),
            "agents": [s.agent for s in parts], "texts": [s.text for s in parts],
            "prompt_token_ids": [s.prompt_token_ids for s in parts], "token_ids": [s.token_ids for s in parts],
            "logprobs": [s.logprobs for s in parts], "adapter_versions": [s.adapter_version for s in parts],
            # the base each part ran on (Sample.meta["model"]; None for rows stored before it was recorded)
            "base_models": [s.meta.get("model") for s in parts],
            # the temperature / top_p each part was sampled at, as JSON (None: stored before it was recorded)
            "sampling": [_json(s.meta.get("sampling")) for s in parts],
            "finish_reasons": [s.finish_reason for s in parts], "combined": j.combined,
            "auto_total": j.auto_total, "auto_max": j.auto_max, "auto_levels": _json(j.auto_levels),
            "auto_details": _json(j.auto_details), "auto_error": j.auto_error,
            # kind = the feedback form (stars / rank / pick_best), detail = its own answer as JSON
            # (value is already that answer on the 1..5 scale, collab_app/online/returns.py)
            "ratings": [{"id": r.id, "rater": r.rater, "value": r.value, "comment": r.comment,
                         "created_at": r.created_at.isoformat(), "kind": r.kind,
                         "detail": None if r.detail is None else json.dumps(r.detail), "session_id": r.session_id,
                         "revision": r.revision, "late": r.late}
                        for r in j.ratings],
            "human_score": human_score(ratings[k], g.max_reward),
            "return": None if got is None else got[0][k],
            "return_source": None if got is None else got[1][k],
        })
    return rows


def _batches(groups: Iterable[GroupRecord], rule: ReturnRule, now: datetime, size: int = 256) -> Iterator[list[dict]]:
    batch: list[dict] = []
    for g in groups:
        batch += group_rows(g, rule, now)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def export(store: Store, out_dir: str, formats: Sequence[str] = FORMATS, rule: ReturnRule | None = None,
           progress: bool = False) -> dict[str, str]:
    """Write the store's joint samples to `out_dir` in `formats`, and its arena pairs beside them;
    returns {format: path, "arena_" + format: path} (plus "meta": a JSON file with the rule, counts
    and time of the export)."""
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"unknown export format(s) {bad}: choose from {FORMATS}")
    rule = rule or ReturnRule()
    now = datetime.now(timezone.utc)
    os.makedirs(out_dir, exist_ok=True)
    stats = store.stats()
    tmp = tempfile.mkdtemp(prefix=".export-", dir=out_dir)
    try:
        jsonl = open(os.path.join(tmp, FILE_NAMES["jsonl"]), "w", encoding="utf-8") if "jsonl" in formats else None
        parquet = pq.ParquetWriter(os.path.join(tmp, FILE_NAMES["parquet"]), SCHEMA) if "parquet" in formats else None
        arrow_path = os.path.join(tmp, "rows.arrow")
        arrow = pa.ipc.new_stream(arrow_path, SCHEMA) if "datasets" in formats else None
        groups = store.iter_groups()
        if progress:
            from tqdm import tqdm
            groups = tqdm(groups, total=sum(stats["groups"].values()), unit="group", desc="export")
        n = 0
        for batch in _batches(groups, rule, now):
            n += len(batch)
            if jsonl:
                jsonl.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in batch)
            if parquet or arrow:
                table = pa.Table.from_pylist(batch, schema=SCHEMA)
                for w in (parquet, arrow):
                    if w:
                        w.write_table(table)
        for w in (jsonl, parquet, arrow):
            if w:
                w.close()
        if arrow:
            import datasets
            datasets.Dataset.from_file(arrow_path).save_to_disk(os.path.join(tmp, FILE_NAMES["datasets"]))
        arena_rows = _write_arena(store, tmp, formats)
        meta = {"exported_at": now.isoformat(), "rows": n, "arena_rows": arena_rows, "rule": asdict(rule), "stats": stats,
                "store": repr(store), "formats": list(formats), "columns": SCHEMA.names}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        out = {}
        names = [(fmt, FILE_NAMES[fmt]) for fmt in formats] + [(f"arena_{fmt}", ARENA_FILE_NAMES[fmt]) for fmt in formats]
        for fmt, name in names + [("meta", "meta.json")]:
            dest = os.path.join(out_dir, name)
            if os.path.isdir(dest):
                shutil.rmtree(dest)
            os.replace(os.path.join(tmp, name), dest)
            out[fmt] = dest
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- CLI

@dataclass
class ExportConfig:
    out: str = ""
    """folder to write into (created; earlier exports there are replaced)."""
    db: str = ""
    """store URL (empty = $COLLAB_DB, else sqlite:///$COLLAB_HOME/collab.db)."""
    format: list[str] = field(default_factory=lambda: list(FORMATS))
    """one or more of: jsonl datasets parquet."""

    def __post_init__(self):
        if not self.out:
            raise ValueError("--out DIR is required: the folder to write the export into")
        bad = [f for f in self.format if f not in FORMATS]
        if bad:
            raise ValueError(f"unknown --format {bad}: choose from {' '.join(FORMATS)}")


def cli_main(argv: list[str] | None = None) -> int:
    from trainer.configcli import add_dataclass_args, parse_config

    cfg, rest = parse_config(ExportConfig, argv, prog="collab export",
                             description="Export groups, samples, rewards and ratings: one row per joint sample.",
                             extra=lambda p: add_dataclass_args(p.add_argument_group("return rule"), ReturnRule))
    try:
        rule = ReturnRule(**vars(rest))
    except ValueError as e:
        print(f"collab export: {e}", file=sys.stderr)
        return 2
    store = Store(cfg.db or None)
    try:
        paths = export(store, cfg.out, cfg.format, rule, progress=True)
    finally:
        store.close()
    with open(paths["meta"]) as f:
        meta = json.load(f)
    rows = meta["rows"]
    print(f"exported {rows} joint samples and {meta['arena_rows']} arena pairs from {store!r}:")
    for fmt, path in paths.items():
        print(f"  {fmt:<9} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())

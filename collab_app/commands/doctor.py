"""`collab doctor`: what this machine gives the app, and whether the loop is turning, checked here.

Sections (plain text, or one JSON object with `--json`):
- cpu: the CPU's model, torch's capability and whether it computes bf16 natively (dtype auto's
  rule, trainer/dtypes.py);
- cpu_budget: the affinity mask, the cgroup CPU quota, the budget both give
  (collab_app/cpu/), the core split `collab serve` would make with this
  `--engine-cores` and the sandbox's concurrency cap;
- sandbox: the isolation level a live run gets (tasks/sandbox.py probes it now);
- engine: the engine `auto` would pick and why, the dtype, and what each agent is served
  (the store's version rows, which hot-swap follows, beside the newest version on disk);
- probe (`--probe`): starts that engine, loads each agent's current adapter (the store's row,
  else the newest in the adapters dir, else a random LoRA, so that a mix-up between agents
  shows), and compares a short greedy generation per agent, and for the base model, with
  transformers+peft computed independently here: token-for-token equal, or the first position
  where they differ;
- training: the trainer service's status and heartbeat, the last step, ready groups per task
  and the served versions, from the store (`--db`, else $COLLAB_DB, as `collab serve`), the
  groups set aside or expired with the reason, and a verdict: advancing, waiting for groups,
  paused, failing or not running.

Read-only except that opening the store runs its schema migrations (as any `collab` command
that opens it does) and `--put-back` (an admin's call: set-aside or expired groups back to
training); a SQLite store that does not exist is reported, not created.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from tasks import SERVED_BY_DEFAULT

log = logging.getLogger(__name__)

PROBE_PROMPT = "Write a Python function that returns the sum of the squares of a list of numbers."
BASE_ROW = "base"   # the probe's agent with no adapter: the base model's own row
# every weight of a random probe adapter x this: at 2 every agent's greedy text differs from the
# base model's and between seeds from the first tokens (tests/conftest.py's make_lora_adapter), so
# serving one agent's weights to another shows at once
RANDOM_LORA_SCALE = 2.0


@dataclass
class DoctorConfig:
    model: str = ""
    """base model: HF id or local folder (empty = $COLLAB_MODEL, else the embedded SmolLM2-135M-Instruct)."""
    engine: Literal["auto", "vllm", "transformers"] = "auto"
    """engine to report on and, with --probe, to start: auto (as `collab serve`), vllm or transformers."""
    db: str = ""
    """store URL (empty = $COLLAB_DB, else sqlite:///$COLLAB_HOME/collab.db, as `collab serve`)."""
    adapters_dir: str = ""
    """adapter versions written by the trainer (empty = $COLLAB_HOME/adapters)."""
    tasks: list[str] = field(default_factory=lambda: list(SERVED_BY_DEFAULT))
    """tasks whose agents (their roles) the app serves, as `collab serve --tasks`."""
    engine_cores: int = 0
    """the `collab serve --engine-cores` whose core split to show (0 = auto, -1 = no split)."""
    min_groups: int = 4
    """K of the trainer (`collab serve --min-groups`): ready groups of one task that make a step due."""
    probe: bool = False
    """start the engine and compare each agent's greedy output with transformers+peft (slow: loads the model twice)."""
    probe_tokens: int = 16
    """new tokens per agent in the probe."""
    json: bool = False
    """print one JSON object instead of text."""
    put_back: list[int] = field(default_factory=list)
    """group ids (from the report's closed groups) to put back: set aside or expired -> open, trained if they have returns."""

    def __post_init__(self):
        if self.engine_cores < -1:
            raise ValueError(f"engine_cores must be -1 (no split), 0 (auto) or a core count, got {self.engine_cores}")
        if self.min_groups < 1 or self.probe_tokens < 1:
            raise ValueError("min_groups and probe_tokens must be >= 1")
        if not self.tasks:
            raise ValueError("--tasks needs at least one task, e.g. --tasks humaneval")
        if any(g < 1 for g in self.put_back):
            raise ValueError(f"--put-back takes group ids (>= 1) from the report's closed groups, got {self.put_back}")


# ----------------------------------------------------------------------------- CPU

def cpu_info() -> dict:
    import torch

    from collab_app.cpu.machine import cpu_model
    from trainer.dtypes import cpu_capability, cpu_has_native_bf16, resolve_device, resolve_dtype

    cap = cpu_capability()
    device = resolve_device("auto")
    return {"model": cpu_model(), "machine": platform.machine(), "torch": torch.__version__,
            "torch_capability": str(torch.backends.cpu.get_cpu_capability()), "capability": cap,
            "native_bf16": cpu_has_native_bf16(cap), "device": device, "dtype_auto": resolve_dtype("auto", device)}


def budget_info(engine_cores: int) -> dict:
    from collab_app.cpu import cores as cpu_cores
    from tasks import sandbox

    cores = cpu_cores.affinity_cores()
    limit = cpu_cores.cgroup_cpu_limit()
    try:
        split = cpu_cores.plan(engine_cores)
        split_text = split.describe() if split else _no_split_why(engine_cores)
    except ValueError as e:
        split, split_text = None, f"refused: {e}"
    return {"affinity": cores, "os_cpu_count": os.cpu_count(),
            "quota_cpus": limit[0] if limit else None, "quota_file": limit[1] if limit else None,
            "budget": cpu_cores.cpu_budget(), "usable_cores": cpu_cores.usable_cores(),
            "split": {"engine": list(split.engine), "trainer": list(split.trainer)} if split else None,
            "split_text": split_text, "sandbox_max_concurrent": sandbox.max_concurrent(),
            "sandbox_max_concurrent_env": os.environ.get(sandbox.MAX_CONCURRENT_ENV) or None}


def _no_split_why(engine_cores: int) -> str:
    from collab_app.engines.device import cuda_available

    if engine_cores == -1:
        return "none (--engine-cores -1): engine and trainer child share every core"
    if cuda_available():
        return "none: a CUDA GPU does the work of both processes"
    return "none: one usable CPU, engine and trainer child share it"


def sandbox_info() -> dict:
    from tasks.sandbox import isolation

    iso = isolation()
    return {k: iso[k] for k in ("mode", "strong", "untrusted_allowed", "summary", "landlock", "cgroup", "probe_notes",
                                "memory", "unconfined", "unconfined_accepted")}


def _memory_line(mem: dict) -> str:
    """What bounds a sandboxed run's memory in all (tasks.sandbox.isolation()["memory"])."""
    total = f"{mem['processes']} processes x {mem['per_process_mb']} MB = {mem['total_mb']} MB"
    if mem["bounded_by"] is None:
        return f"UNBOUNDED (nothing here bounds a run's memory in all): people's own code is refused; {total} per run"
    return f"bounded by {mem['bounded_by']}: {total} per run at most"


def _confinement_line(s: dict) -> str:
    """Whether model code runs confined (a public app refuses to start unconfined unless accepted)."""
    if not s["unconfined"]:
        return "confined (" + s["mode"] + (", Landlock" if s.get("landlock") else "") + ")"
    return ("UNCONFINED: runs as this user with nothing confining it; a public app "
            + ("starts anyway (COLLAB_SANDBOX_ALLOW_UNCONFINED=1)" if s["unconfined_accepted"]
               else "refuses to start (exit 2) unless COLLAB_SANDBOX_ALLOW_UNCONFINED=1"))


# ----------------------------------------------------------------------------- engine and agents

def agent_names(tasks: list[str]) -> list[str]:
    """Every agent the app serves: the roles of its tasks (tasks with the same roles share them)."""
    from tasks import load_task

    names: list[str] = []
    for t in tasks:
        names += [r for r in load_task(t).roles if r not in names]
    return names


def engine_choice(kind: str, model: str = "") -> dict:
    """The engine `make_engine(kind)` would build, without starting it (collab_app/engines/__init__.py;
    on a CPU the engine race cached for `model` if any: never raced here)."""
    from collab_app.engines.choose import auto_choice

    kind = kind if kind != "auto" else os.environ.get("COLLAB_ENGINE", "auto")
    vllm = importlib.util.find_spec("vllm") is not None
    if kind.startswith(("http://", "https://")):
        return {"kind": "remote", "why": f"COLLAB_ENGINE={kind}", "vllm_installed": vllm}
    if kind != "auto":
        return {"kind": kind, "why": "asked for", "vllm_installed": vllm}
    from collab_app.engines.model import EMBEDDED_NAME, embedded_dir

    model = model or os.environ.get("COLLAB_MODEL") or EMBEDDED_NAME
    folder = str(embedded_dir()) if model == EMBEDDED_NAME else os.path.expanduser(model)
    order, why = auto_choice(folder if os.path.isdir(folder) else None)
    then = "".join(f"; {b} if {a} does not start" for a, b in zip(order, order[1:]))
    return {"kind": order[0], "vllm_installed": vllm,
            "why": f"auto: {why}{then}" + (" (--probe starts it)" if then else "")}


def open_store(url: str):
    """The store, or (None, why) where a SQLite file is not there yet (never creates one)."""
    import sqlalchemy as sa

    from collab_app.online.store import Store

    u = sa.engine.make_url(url)
    if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:") \
            and not os.path.exists(u.database):
        return None, f"no store at {u.database} yet: `collab serve` (or `collab trainer`) creates it"
    try:
        return Store(url), ""
    except Exception as e:  # noqa: BLE001 - report, not crash
        return None, f"cannot open the store ({type(e).__name__}: {e}); check --db / COLLAB_DB"


def served_versions(store, agents: list[str], adapters_dir: str) -> list[dict]:
    """Per agent: the version hot-swap serves (the store's row: pinned, else newest) and the newest
    complete version on disk."""
    from trainer.adapters import latest_version

    current = store.current_adapter_versions() if store else {}
    latest = store.latest_adapter_versions() if store else {}
    out = []
    for a in agents:
        disk = latest_version(adapters_dir, a) if os.path.isdir(adapters_dir) else None
        row = current.get(a)
        out.append({"agent": a, "served": row[0] if row else None, "path": row[1] if row else None,
                    "pinned": bool(row and a in latest and latest[a].version != row[0]),
                    "disk_latest": disk[0] if disk else None})
    return out


# ----------------------------------------------------------------------------- probe

def _random_adapters(model_path: str, agents: list[str], out_dir: str) -> dict[str, str]:
    """A random LoRA per agent, each from its own seed: {agent: dir}."""
    from collab_app.commands.bench import make_random_lora

    return {a: make_random_lora(model_path, os.path.join(out_dir, a), seed=k, scale=RANDOM_LORA_SCALE)
            for k, a in enumerate(agents)}


def _reference(model_path: str, dtype: str, device: str, rows: list[tuple[str, str | None]],
               prompt_ids: list[int], max_new: int) -> dict[str, list[int]]:
    """Greedy tokens per row with plain transformers+peft (no collab engine code): the base model
    for a row without an adapter, else that row's adapter active. EOS kept, nothing after it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    ids = torch.tensor([prompt_ids], device=device)

    def greedy(m) -> list[int]:
        with torch.no_grad():
            out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, pad_token_id=next(iter(eos_ids), 0))
        toks = out[0, len(prompt_ids):].tolist()
        cut = next((i + 1 for i, t in enumerate(toks) if t in eos_ids), len(toks))
        return toks[:cut]

    got = {name: greedy(model) for name, path in rows if path is None}
    peft = None
    for name, path in rows:
        if path is None:
            continue
        if peft is None:
            peft = PeftModel.from_pretrained(model, path, adapter_name=name).eval()
        else:
            peft.load_adapter(path, adapter_name=name)
        peft.set_adapter(name)
        got[name] = greedy(peft)
    return got


def probe(cfg: DoctorConfig, agents: list[str], versions: list[dict], adapters_dir: str) -> dict:
    """Start the engine, serve each agent's current adapter, compare greedy output with transformers+peft."""
    from collab_app.engines.requests import chat_prompt_ids
    from collab_app.engines.choose import make_engine
    from collab_app.engines.engine_types import Request, Sampling
    from collab_app.engines.model import ensure_model
    from trainer.adapters import latest_version, version_dir
    from trainer.dtypes import resolve_device

    model_path = ensure_model(cfg.model or None)
    tmp = tempfile.mkdtemp(prefix="collab-doctor-")
    try:
        rows: list[tuple[str, str | None]] = [(BASE_ROW, None)]
        sources = {BASE_ROW: ("base model", None)}
        need_random = []
        for v in versions:
            a = v["agent"]
            if v["served"] is not None:
                path = v["path"] if os.path.isdir(v["path"]) else version_dir(adapters_dir, a, v["served"])
                rows.append((a, path))
                sources[a] = ("store row" + (" (pinned)" if v["pinned"] else ""), v["served"])
            elif (disk := latest_version(adapters_dir, a) if os.path.isdir(adapters_dir) else None):
                rows.append((a, disk[1]))
                sources[a] = ("adapters dir", disk[0])
            else:
                need_random.append(a)
        if need_random:
            made = _random_adapters(model_path, need_random, tmp)
            rows += [(a, made[a]) for a in need_random]
            sources.update({a: ("random LoRA (no version yet)", None) for a in need_random})
        t0 = time.perf_counter()
        # serve's in-graph LoRA lanes (a compiled engine then loads serve's traced model); a call
        # naming more agents runs in parts (engine_vllm's _parts)
        from collab_app.engines.engine_race import serve_lanes

        eng = make_engine(cfg.engine, model=model_path, num_agents=len(rows), lora_lanes=serve_lanes())
        start_s = time.perf_counter() - t0
        try:
            for name, path in rows:
                eng.register_agent(name)
                if path is not None:
                    eng.load_adapter(name, path, sources[name][1])
            sampling = Sampling(max_new_tokens=cfg.probe_tokens, temperature=0.0)
            requests = [Request(agent=name, prompt=PROBE_PROMPT) for name, _ in rows]
            t0 = time.perf_counter()
            served = eng.generate(requests, n=1, sampling=sampling)
            gen_s = time.perf_counter() - t0
            dtype = getattr(eng, "dtype", None) or "float32"
            engine_name = getattr(eng, "name", type(eng).__name__)
        finally:
            eng.close()
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        prompt_ids = chat_prompt_ids(tok, requests[0])
        ref = _reference(model_path, dtype, resolve_device("auto"), rows, prompt_ids, cfg.probe_tokens)
        results = []
        for (name, _), out in zip(rows, served):
            s = out[0]
            a, b = list(s.token_ids), ref[name]
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if first is None and len(a) != len(b):
                first = min(len(a), len(b))
            results.append({"agent": name, "source": sources[name][0], "version": sources[name][1],
                            "equal": first is None and list(s.prompt_token_ids) == prompt_ids,
                            "first_difference": first, "prompt_equal": list(s.prompt_token_ids) == prompt_ids,
                            "tokens": len(a), "engine_text": s.text, "reference_text": tok.decode(b)})
        texts = [r["engine_text"] for r in results]
        return {"engine": engine_name, "dtype": dtype, "start_s": round(start_s, 1), "generate_s": round(gen_s, 2),
                "prompt": PROBE_PROMPT, "agents": results,
                "all_equal": all(r["equal"] for r in results),
                "same_text_for_every_row": len(results) > 1 and len(set(texts)) == 1}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- training

def training_info(store, why_none: str, min_groups: int) -> dict:
    from collab_app.online.returns import CUSTOM_TRAINING_KEY, may_train_shared
    from collab_app.online.service import ServiceConfig, read_status
    from tasks import team_of

    if store is None:
        return {"verdict": f"unknown: {why_none}"}
    st = read_status(store)
    steps = store.train_steps(last=1)
    limit = 4 * ServiceConfig.max_groups_per_step
    ready = store.ready_groups(ServiceConfig().rule(), limit=limit)
    allowed = store.get_state(CUSTOM_TRAINING_KEY)
    by_task = Counter(team_of(g.task) for g in ready if may_train_shared(g.task, allowed))
    held = sum(1 for g in ready if not may_train_shared(g.task, allowed))
    now = time.time()
    last = None
    if steps:
        s = steps[-1]
        last = {"step": s["step"], "age_s": round(now - s["created_at"].timestamp(), 1), "groups": len(s["group_ids"]),
                "task": (s["metrics"] or {}).get("task")}
    beat = st.get("heartbeat")
    info = {"status": st.get("state"), "alive": st.get("alive"), "message": st.get("message"),
            "heartbeat_age_s": round(now - float(beat), 1) if beat else None, "pid": st.get("pid"),
            "last_step": last, "ready_groups": dict(by_task), "ready_groups_capped": len(ready) >= limit,
            "ready_held_private": held, "store_counts": store.stats(),
            "closed_groups": [{**g, "created_at": g["created_at"].isoformat()} for g in store.closed_groups(CLOSED_SHOWN)]}
    info["verdict"] = _verdict(info, min_groups)
    return info


CLOSED_SHOWN = 10
"""newest set-aside or expired groups the report lists."""


def _ago(s: float | None) -> str:
    if s is None:
        return "never"
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _verdict(t: dict, k: int) -> str:
    due = [task for task, n in t["ready_groups"].items() if n >= k]
    last = t["last_step"]
    if not t["alive"]:
        return (f"NOT ADVANCING: no live trainer on this store (status {t['status']!r}, heartbeat "
                f"{_ago(t['heartbeat_age_s'])}); `collab serve` runs one as its child (--trainer child), or run "
                "`collab trainer --db <this store>`")
    if t["status"] == "paused":
        return "PAUSED by an admin: resume in the app's Training tab"
    if t["status"] == "waiting":
        return f"NOT ADVANCING: {t['message']}"
    if t["status"] == "error":
        return f"NOT ADVANCING: the trainer's last attempt failed and it is backing off: {t['message']}"
    if t["status"] in ("training", "loading"):
        return f"advancing: a step is running now (last finished step {last['step'] if last else 'none'})"
    if due:
        return (f"a step is due ({', '.join(due)}: >= {k} ready groups) and the trainer is {t['status']}; "
                "if this lasts beyond a poll or two, see the trainer's log")
    when = f"last step {_ago(last['age_s'])}" if last else "no step yet"
    return (f"waiting for groups: the trainer is alive, {when}; a step needs {k} ready groups of one task "
            "(or the oldest to wait --max-wait-s)")


# ----------------------------------------------------------------------------- report

def report(cfg: DoctorConfig) -> dict:
    from collab_app import paths

    adapters_dir = cfg.adapters_dir or paths.adapters_dir()
    url = cfg.db or paths.store_url()
    store, why = open_store(url)
    try:
        if cfg.put_back:
            if store is None:
                raise SystemExit(f"collab doctor: --put-back needs the store: {why}")
            n = store.put_back(cfg.put_back)
            print(f"put {n} of {len(cfg.put_back)} groups back (the others were not set aside or expired, or have "
                  f"fewer than 2 answers per agent)", file=sys.stderr)
        agents = agent_names(cfg.tasks)
        versions = served_versions(store, agents, adapters_dir)
        rep = {"cpu": cpu_info(), "cpu_budget": budget_info(cfg.engine_cores), "sandbox": sandbox_info(),
               "engine": {**engine_choice(cfg.engine, cfg.model), "agents": versions, "adapters_dir": adapters_dir},
               "training": {"store": _redact(url), **training_info(store, why, cfg.min_groups)}}
        if cfg.probe:
            rep["probe"] = probe(cfg, agents, versions, adapters_dir)
        return rep
    finally:
        if store is not None:
            store.close()


def _redact(url: str) -> str:
    import sqlalchemy as sa

    return sa.engine.make_url(url).render_as_string(hide_password=True)


def format_text(r: dict) -> str:
    c, b, s, e, t = r["cpu"], r["cpu_budget"], r["sandbox"], r["engine"], r["training"]
    aff = b["affinity"]
    affinity = f"{len(aff)} cores ({_cores(aff)})" if aff is not None else "no affinity API"
    quota = f"{b['quota_cpus']:g} CPUs ({b['quota_file']})" if b["quota_cpus"] else "none"
    cap_env = b["sandbox_max_concurrent_env"]
    cgroup = s["cgroup"]
    lines = [
        "CPU",
        f"  model          {c['model']} ({c['machine']})",
        f"  torch          {c['torch']}: capability {c['torch_capability']} ({c['capability']}); native bf16: "
        f"{'yes' if c['native_bf16'] else 'no'}; device {c['device']}, dtype auto = {c['dtype_auto']}",
        "CPU budget",
        f"  affinity       {affinity}; os.cpu_count() {b['os_cpu_count']}",
        f"  cgroup quota   {quota}",
        f"  budget         {b['budget']} CPUs: cores {_cores(b['usable_cores'])}",
        f"  serve's split  {b['split_text']}",
        f"  sandbox cap    {b['sandbox_max_concurrent']} runs at once"
        + (f" (COLLAB_SANDBOX_MAX_CONCURRENT={cap_env})" if cap_env else ""),
        "Sandbox",
        f"  isolation      {s['mode']} ({'strong' if s['strong'] else 'WEAK'}): {s['summary']}",
        f"  per-run cgroup {'on: ' + str(cgroup['path']) if cgroup['enabled'] else 'off: ' + cgroup['reason']}",
        f"  memory         {_memory_line(s['memory'])}",
        f"  model code     {_confinement_line(s)}",
        "Engine",
        f"  would start    {e['kind']} ({e['why']})",
        f"  adapters dir   {e['adapters_dir']}",
    ]
    for a in e["agents"]:
        served = (f"v{a['served']}{' (pinned)' if a['pinned'] else ''}" if a["served"] is not None
                  else "base model (no version row in the store)")
        disk = f"newest on disk v{a['disk_latest']}" if a["disk_latest"] is not None else "none on disk"
        lines.append(f"  {a['agent']:<14} serves {served}; {disk}")
    if "probe" in r:
        p = r["probe"]
        lines += ["Probe (greedy, vs transformers+peft)",
                  f"  engine         {p['engine']} ({p['dtype']}), started in {p['start_s']} s, "
                  f"{max(a['tokens'] for a in p['agents'])} tokens per row in {p['generate_s']} s"]
        for a in p["agents"]:
            v = f" v{a['version']}" if a["version"] is not None else ""
            verdict = ("equal" if a["equal"] else
                       "prompt tokens differ" if not a["prompt_equal"] else f"differs at token {a['first_difference']}")
            lines.append(f"  {a['agent']:<14} {verdict:<20} {a['source']}{v}: {a['engine_text'][:60]!r}")
            if not a["equal"]:
                lines.append(f"  {'':<14} {'':<20} transformers+peft: {a['reference_text'][:60]!r}")
        if p["same_text_for_every_row"]:
            lines.append("  WARNING        every row got the same text: the engine may serve one set of weights to all")
        elif not p["all_equal"]:
            lines.append("  note           bf16 rounding can flip a late greedy choice; a difference at token 0-1, or "
                         "agents matching each other instead of their reference, means wrong weights")
    lines += ["Training", f"  store          {t['store']}"]
    if "status" in t:
        last = t["last_step"]
        last_text = f"#{last['step']}, {_ago(last['age_s'])}, {last['groups']} groups" if last else "none"
        ready = ", ".join(f"{k} {n}" for k, n in sorted(t["ready_groups"].items())) or "none"
        held = t["ready_held_private"]
        lines += [
            f"  trainer        {t['status']} ({'alive' if t['alive'] else 'not alive'}, heartbeat "
            f"{_ago(t['heartbeat_age_s'])}, pid {t['pid']})" + (f": {t['message']}" if t["message"] else ""),
            f"  last step      {last_text}",
            f"  ready groups   {ready}" + (" (and more)" if t["ready_groups_capped"] else "")
            + (f"; {held} of people's own problems held (not allowed to train the team)" if held else ""),
        ]
    for g in t.get("closed_groups") or []:
        lines.append(f"  {g['status']:<14} #{g['id']} {g['task']}, {g['ratings']} ratings: {g['reason'] or 'no reason recorded'}")
    if t.get("closed_groups"):
        lines.append("  put back       collab doctor --put-back ID ... (an admin's call; the Training tab has it too)")
    lines.append(f"  verdict        {t['verdict']}")
    return "\n".join(lines)


def _cores(cores) -> str:
    return ",".join(map(str, cores))


def cli_main(argv: list[str] | None = None) -> int:
    from trainer.configcli import parse_config

    cfg, _ = parse_config(DoctorConfig, argv, prog="collab doctor",
                          description="What this machine gives the app (CPU, CPU budget, sandbox, engine, "
                                      "training), checked here; --probe also compares the engine's output per "
                                      "agent with transformers+peft.")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    if cfg.probe:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()   # one bar per model load would bury the report on stderr
    rep = report(cfg)
    print(json.dumps(rep, default=str) if cfg.json else format_text(rep))
    return 0

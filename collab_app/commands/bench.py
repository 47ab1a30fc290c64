"""`collab bench generate`: the same team workloads through vLLM and transformers, side by side.

Two workloads, each engine in its own subprocess (start-up and peak RSS its own):
- interactive (what a person feels): 1 prompt, 2 agents with random LoRA adapters, G=4 samples
  per agent, 128 new tokens, streamed: median time to the first words and to the whole round;
  `--beside-training` repeats it while `training_load()` (commands/training_load.py) runs MAGRPO updates in a child
  process, `--think-s S` waits S seconds before each round, as a person reads;
- rollout (`--prompts`, 0 = skip): 16 prompts x G=4 per agent in one batched call, in tokens/s.
`--engines` picks the contestants: `vllm` (the engine as `collab serve` builds it on this machine:
calibrated dtype and base GEMMs, compiled where the race chose it, serve's core split and
borrowing), variants of it with one thing changed (`vllm-eager`, `vllm-noborrow`, `vllm-spawn`,
`vllm-onednn`, `vllm-fp16`, `vllm-int8`, `vllm-compiled`), `transformers`, `transformers-torch`,
`remote` (a vLLM server over HTTP) and `plain` (eager fp32 `model.generate`, no adapters: the
baseline a reader knows). Every run also prints the floor (the weights' bytes x decode steps / one
core's read bandwidth), the dtype and the CPU capability. Each variant and how it is timed:
docs/BENCHES.md; figures on both CPU kinds: docs/results/README.md.

`collab bench train ...` runs collab_app.commands.bench_train:run(argv) (MAGRPO step benchmark).
`collab bench comlrl ...` runs collab_app.commands.bench_comlrl:cli_main(argv) (PyPI comlrl's MAGRPO
at a wall-clock budget, evaluated before/after).
`collab bench page ...` runs collab_app.commands.bench_page:cli_main(argv) (a person's round in the
real page, headless Chromium, next to the same rounds through the API).
`collab bench abuse ...` runs collab_app.commands.bench_abuse:cli_main(argv) (one network with many
identities against honest raters: share of trained groups, latency, ratings kept, refusals).
`collab bench faults ...` runs collab_app.commands.bench_faults:cli_main(argv) (scripted raters while
faults are injected: ratings accepted vs stored vs trained, and per fault whether learning resumed).
`collab bench arena ...` runs collab_app.commands.bench_arena:cli_main(argv) (a scripted rater trains
the team, then a scripted voter with the same preference votes blind pairs through /v1/arena: votes
to separate two states, Kendall's tau of step order vs board).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from collab_app.cpu.process import THP_VAR
from collab_app.engines import engine_race
from collab_app.engines.model import make_random_lora  # noqa: F401 - where benches, tests and result scripts find it

TASKS = [
    "reverse the words of a sentence", "count vowels in a string", "merge two sorted lists",
    "check whether a number is prime", "flatten a nested list", "compute a running average",
    "find the longest common prefix", "convert Celsius to Fahrenheit for a list", "remove duplicates keeping order",
    "parse 'key=value' pairs into a dict", "rotate a matrix by 90 degrees", "validate balanced brackets",
    "return the n-th Fibonacci number", "group words that are anagrams", "sum the digits of an integer",
    "find the second largest number",
]
# The vLLM engine's variants: VLLMEngine keywords ("quantize": "auto" = the calibration's choice,
# as `collab serve` makes it; None = vLLM's own oneDNN GEMMs in the calibrated dtype). Where a
# variant names no enforce_eager, the app's compile rule decides (engines.vllm_compile_kw).
VLLM_VARIANTS = {
    "vllm": {"quantize": "auto"},                                  # what the app serves
    "vllm-eager": {"quantize": "auto", "enforce_eager": True},     # never compiled
    "vllm-noborrow": {"quantize": "auto"},                         # serve --no-borrow-cores
    "vllm-spawn": {"quantize": "auto", "in_process": False},       # engine core + worker in 2 spawned processes
    "vllm-onednn": {"quantize": None},                             # vLLM's own base GEMMs
    "vllm-fp16": {"quantize": "fp16"},                             # fp16 weights, fp32 activations and sums
    "vllm-int8": {"quantize": "int8"},                             # dynamic int8 (not exact)
    "vllm-compiled": {"quantize": None, "enforce_eager": False},   # torch.compile'd by vLLM (bf16 CPUs)
}
HF_VARIANTS = ("transformers", "transformers-torch")   # the app's transformers engine; with torch's own GEMMs
# Under --beside-training every engine that decodes in this process borrows the trainer's cores
# between its steps, as `collab serve` (borrow_cores) does, except this one (lending.CoreLease).
NO_BORROWING = {"vllm-noborrow"}

ROLES = engine_race.ROLES   # one team for the bench and the engine race (engines/engine_race.py)


# -- worker: one engine, in its own process ------------------------------------------------------
def _worker(args) -> None:
    from collab_app.engines.engine_types import Sampling
    from collab_app.engines.team import Agent, Team

    status = Path(args.status)
    split = lease_path = None
    if args.engine == "plain":   # every core, as a reader's transformers would have (and the engines' quiet rounds)
        Path(args.out).write_text(json.dumps(_plain(args, status)))
        return
    race_s = race_first(args.engine, args.model_path, status)
    if args.beside_training:
        # As `collab serve` with its trainer child: the engine on its share of the cores, applied
        # before the engine starts (vLLM binds its OpenMP threads at start-up); the training loop
        # of training_load() gets the rest. Both interactive measurements run under this split.
        from collab_app.cpu.cores import apply_to_serving, plan

        split = plan(0)
        if split is not None:
            apply_to_serving(split)
            if args.engine not in NO_BORROWING:   # as serve's borrow_cores: the training loop holds the lease per step
                lease_path = str(Path(args.status).with_name("trainer-cores.lock"))
    status.write_text("starting engine")
    t0 = time.perf_counter()
    server, server_dtype = contextlib.ExitStack(), None
    args.dtype, quantize = engine_precision(args.engine, args.dtype, args.model_path)
    if args.engine == "remote":
        # vLLM's OpenAI server as a child of this worker (its RSS counts in the tree, its start in
        # start-up), RemoteVLLMEngine over HTTP: the `collab serve --engine-url` path
        from collab_app.engines.engine_remote import RemoteVLLMEngine, local_server
        from trainer.dtypes import resolve_dtype

        status.write_text("starting the vLLM server")
        url = server.enter_context(local_server(
            args.model_path, dtype=resolve_dtype(args.dtype, "cpu"), max_model_len=args.max_model_len,
            max_lora_rank=max(8, args.lora_rank), max_loras=4, log_path=args.status + ".server.log"))
        engine = RemoteVLLMEngine(args.model_path, url)
        server_dtype = resolve_dtype(args.dtype, "cpu")   # the server's (the engine holds no weights)
    elif args.engine in VLLM_VARIANTS:
        from collab_app.engines.engine_vllm import VLLMEngine

        # serve's default agent slots and in-graph LoRA lanes, as the race builds it: the engine
        # `make run` serves (a compiled graph holds its lanes; the same graph is then in inductor's
        # cache), whose lanes are also `collab train`'s (a team's agents)
        engine = VLLMEngine(args.model_path, dtype=args.dtype, max_model_len=args.max_model_len,
                            num_agents=engine_race.serve_slots(), lora_lanes=engine_race.serve_lanes(),
                            max_lora_rank=max(8, args.lora_rank), quantize=quantize,
                            **vllm_variant_kw(args.engine, args.model_path, args.dtype, quantize))
    else:
        from collab_app.engines.engine_hf import TransformersEngine

        engine = TransformersEngine(args.model_path, dtype=args.dtype, max_model_len=args.max_model_len,
                                    num_threads=args.hf_threads or None, quantize=quantize,
                                    decode_thread=True)   # as `collab serve` builds it
    startup = time.perf_counter() - t0
    lent = 0   # engine parts decoding on the borrowed cores (none where vLLM decodes in another process)
    if lease_path:
        from collab_app.cpu.lending import lend_trainer_cores

        lent = lend_trainer_cores(engine, split, lease_path, lend_engine_cores=True)   # as serve does
    team = Team([Agent(name, role) for name, role in ROLES.items()])
    for a, path in zip(team.agents, args.adapters or [None, None]):
        engine.register_agent(a.name)
        if path:
            engine.load_adapter(a.name, path, 1)
    prompts = [[f"Task: {TASKS[k % len(TASKS)]}."] * 2 for k in range(args.prompts)]
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    status.write_text("warm-up")
    team.generate(engine, [[f"Task: {TASKS[0]}."] * 2], 1, Sampling(max_new_tokens=8, temperature=args.temperature))

    def widened() -> int | None:
        spare = getattr(engine, "spare_cores", None)
        return spare.widened if spare is not None else None

    def interactive(label):
        """What a person feels: 1 prompt, G samples per agent, streamed; median over rounds of the
        time to the first non-empty text and to the whole round."""
        ttft, full, tokens, wide = [], [], [], []
        wide0 = widened()
        for k in range(args.rounds):
            status.write_text(f"interactive round {k + 1}/{args.rounds} ({label})")
            time.sleep(args.think_s)   # a person reading the last round (0 = back to back)
            wide.append(widened())
            t, first, last = time.perf_counter(), None, None
            for last in team.generate_stream(engine, [[f"Task: {TASKS[k % len(TASKS)]}."] * 2],
                                             args.num_generations, sampling):
                if first is None and any(x for per_agent in last.texts[0] for x in per_agent):
                    first = time.perf_counter() - t
            full.append(time.perf_counter() - t)
            ttft.append(first if first is not None else full[-1])
            tokens.append(sum(len(s.token_ids) for per_agent in last.done[0] for s in per_agent))
        out = {"first_text_s": round(statistics.median(ttft), 2), "round_s": round(statistics.median(full), 2),
               "rounds_s": [round(x, 2) for x in full], "tokens_per_round": round(statistics.median(tokens)),
               "load_avg_1m": round(os.getloadavg()[0], 2)}
        if wide0 is not None:   # decode steps taken on the borrowed cores too, in all and per round
            out["borrowed_steps"] = widened() - wide0
            out["borrowed_steps_per_round"] = [b - a for a, b in zip(wide, [*wide[1:], widened()])]
        return out

    def timed(label):
        status.write_text(f"generating ({label})")
        t = time.perf_counter()
        out = team.generate(engine, prompts, args.num_generations, sampling)
        dt = time.perf_counter() - t
        tokens = sum(len(s.token_ids) for ex in out for per_agent in ex for s in per_agent)
        return {"gen_s": round(dt, 2), "tokens": tokens, "tokens_per_s": round(tokens / dt, 1)}

    result = {"startup_s": round(startup, 1), **({"race_s": race_s} if race_s is not None else {}),
              "dtype": server_dtype or getattr(engine, "dtype", args.dtype),
              "quantize": getattr(engine, "quantize", None), "compiled": getattr(engine, "compiled", False),
              "borrows_cores": lent > 0,
              "interactive": interactive("quiet")}
    if args.beside_training:
        # A MAGRPO update loop in a child process (collab_app.online.cpushare) on the trainer's
        # cores, the way `collab serve` runs its trainer child.
        from collab_app.commands.training_load import training_load

        # pause_credit off: the loop's steps come back to back, so under the credit rule it would
        # pause as a trainer behind on its ratings does (hardly at all: the arm below); off, as serve's
        # trainer does when it was idle before the step (a person's pace, ServiceConfig.pause_credit)
        with training_load(dtype=result["dtype"], core_lease=lease_path, lend_engine_cores=True,
                           pause_credit=False) as load:
            result["interactive_beside_training"] = {**interactive("beside a training step"),
                                                     "training": load.status()}
        if lease_path:   # the baseline of the pause: the same step never pausing for a round (yield_share 0)
            with training_load(dtype=result["dtype"], core_lease=lease_path, yield_share=0.0,
                               lend_engine_cores=True) as load:
                result["interactive_beside_training_no_pause"] = {**interactive("beside a step that never pauses"),
                                                                  "training": load.status()}
    if args.prompts:
        result.update(timed("adapters" if args.adapters else "base"))
    if args.base_too and args.adapters and args.prompts:
        for a in team.agents:
            engine.load_adapter(a.name, None, None)
        result["base"] = timed("base")
    Path(args.out).write_text(json.dumps(result))
    engine.close()
    server.close()


def engine_precision(engine: str, dtype: str, model_path: str) -> tuple[str, str | None]:
    """(dtype, quantize) the bench builds `engine` with: a variant's fixed base GEMMs (fp16 / int8
    run fp32 activations), else what `collab serve` would serve here (`_auto_precision`). Where
    no calibration ran, vLLM gets its own GEMMs and the transformers engine "auto" (its flags rule,
    engines.flags_quantize); `transformers-torch` always gets torch's own."""
    quantize = VLLM_VARIANTS[engine]["quantize"] if engine in VLLM_VARIANTS else \
        {"transformers": "auto", "transformers-torch": None}.get(engine)
    if quantize not in (None, "auto"):
        dtype = "float32"
    if dtype == "auto" and engine in (*VLLM_VARIANTS, *HF_VARIANTS):
        precision = _auto_precision(model_path, "vllm" if engine in VLLM_VARIANTS else "transformers")
        dtype = precision.get("dtype", "auto")
        if quantize == "auto" and "quantize" in precision:
            quantize = precision["quantize"]
    if quantize == "auto" and engine in VLLM_VARIANTS:
        quantize = None
    return dtype, quantize


def race_first(engine: str, model_path: str, status: Path | None = None) -> float | None:
    """Seconds spent on the engine race (`vllm_variant_kw`'s compile rule) before the engine starts,
    for a vLLM variant that leaves compiling to that rule; None for the others. The race is cached
    once per machine and run now where it is missing (e.g. after a change of calibrate's machine
    key), as `collab serve` does: before the worker confines itself to the engine's cores, so that
    the race's child engines measure on every core as its cache key says, and off the start-up
    clock, so that `startup_s` is the engine's own (a first run's was 86 s, 67 s of them the race)."""
    if engine not in VLLM_VARIANTS or "enforce_eager" in VLLM_VARIANTS[engine]:
        return None
    from collab_app.engines.choose import auto_choice

    if status is not None:
        status.write_text("engine race (once per machine)")
    t = time.perf_counter()
    auto_choice(model_path, measure=True)
    return round(time.perf_counter() - t, 1)


def vllm_variant_kw(engine: str, model_path: str, dtype: str, quantize: str | None) -> dict:
    """VLLMEngine keywords of a vLLM variant beyond dtype and quantize: the variant's own, and
    where it names no enforce_eager, the app's compile rule (engines.vllm_compile_kw, as
    make_engine applies it): `vllm` runs compiled exactly where `collab serve` would."""
    from collab_app.engines.choose import vllm_compile_kw

    kw = {k: v for k, v in VLLM_VARIANTS[engine].items() if k != "quantize"}
    if "enforce_eager" not in kw:
        # cached: race_first ran it (or found it) before the split; a race that failed is not run twice
        kw.update(vllm_compile_kw(model_path, dtype, quantize, kw.get("in_process", True)))
    return kw


def _auto_precision(model_path: str, kind: str) -> dict:
    """dtype "auto" as `collab serve` resolves it (engines.make_engine): on a CPU, this machine's
    calibration (engines/calibrate.py: {"dtype", "quantize": a less exact base GEMM where one
    won, else None}), so the bench times what the app would serve; else (a GPU, COLLAB_CALIBRATE=0, a
    failed calibration) {} = the engines' own "auto"."""
    import os

    from collab_app.engines.calibrate import cpu_precision

    from collab_app.engines.device import cuda_available

    if cuda_available() or os.environ.get("COLLAB_CALIBRATE", "1") == "0":
        return {}
    return cpu_precision(model_path, kind)


def _plain(args, status: Path) -> dict:
    """The baseline a reader knows: plain eager transformers at its default dtype (fp32), no
    adapters, no streaming, `model.generate` on the interactive round's rows (2 agents x G rows
    of one prompt) for exactly max_new_tokens each (EOS suppressed, as the bench's adapters
    never stop early): the same tokens as one interactive round of the engines."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.dtypes import resolve_device

    status.write_text("loading")
    t0 = time.perf_counter()
    # on the device the transformers engine takes (cuda > mps > cpu): on a GPU the baseline a
    # reader knows is eager transformers on that GPU, not on the host's CPU
    device = resolve_device("auto")
    tok = AutoTokenizer.from_pretrained(args.model_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).to(device).eval()
    startup = time.perf_counter() - t0
    rows = 2 * args.num_generations
    ids = tok.apply_chat_template([{"role": "user", "content": f"Task: {TASKS[0]}."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"].repeat(rows, 1).to(device)
    if device != "cpu":   # warm-up: the first CUDA call compiles/loads kernels
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, pad_token_id=tok.eos_token_id)
    full = []
    for k in range(args.rounds):
        status.write_text(f"round {k + 1}/{args.rounds}")
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=args.temperature,
                                 max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                                 pad_token_id=tok.eos_token_id)
        if device.startswith("cuda"):   # generate returns before the GPU is done
            torch.cuda.synchronize()
        full.append(time.perf_counter() - t)
        assert out.shape == (rows, ids.shape[1] + args.max_new_tokens)
    return {"startup_s": round(startup, 1), "dtype": "float32", "device": device, "threads": torch.get_num_threads(),
            "interactive": {"round_s": round(statistics.median(full), 2), "rounds_s": [round(x, 2) for x in full],
                            "tokens_per_round": rows * args.max_new_tokens, "load_avg_1m": round(os.getloadavg()[0], 2),
                            "streamed": False}}


def read_bandwidth_gbs(mb: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth of one core as torch sees it: the best of `repeats` sums over an
    fp32 buffer far larger than the caches (GB/s)."""
    import torch

    x = torch.ones(mb * 2**20 // 4)
    best = float("inf")
    with _threads(1):
        for _ in range(repeats):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
    return round(x.numel() * 4 / best / 1e9, 1)


@contextlib.contextmanager
def _threads(n: int):
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def floor(model_path: str, max_new_tokens: int, bandwidth_gbs: float) -> dict:
    """The round time no engine can beat on this memory: every decode step reads every weight
    once (one batch for the whole team), at the measured read bandwidth. fp32, fp16 and int8
    (linear layers and LM head in fp16 / int8, the rest fp32) weights. Attention and KV reads are left out: at
    128 tokens of a 135M model they are small next to the weights."""
    from safetensors import safe_open

    params = linear = 0
    for f in Path(model_path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                n = h.get_slice(k).get_shape()
                size = 1
                for d in n:
                    size *= d
                params += size
                linear += size if len(n) == 2 and "norm" not in k else 0
    fp32 = params * 4
    out = {"bandwidth_gbs": bandwidth_gbs}
    for kind, nbytes in (("fp32", params * 4), ("fp16", linear * 2 + (params - linear) * 4),
                         ("int8", linear * 1 + (params - linear) * 4)):
        out[f"weight_gb_{kind}"] = round(nbytes / 1e9, 3)
        out[f"round_s_{kind}"] = round(nbytes * max_new_tokens / (bandwidth_gbs * 1e9), 2)
    return out


# -- parent: run each engine's worker, poll RSS, print -------------------------------------------
def _tree_memory(proc, pss: bool) -> tuple[int, int]:
    """(RSS, PSS) summed over `proc` and its descendants. RSS counts pages shared between vLLM's
    processes once per process (as docs/ENGINES.md's RSS figures do); PSS splits them (reading
    smaps is slower, so the caller asks for it about once a second). PSS is 0 where the OS has none."""
    import psutil

    rss = pss_total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            if pss:
                info = p.memory_full_info()
                rss, pss_total = rss + info.rss, pss_total + getattr(info, "pss", 0)
            else:
                rss += p.memory_info().rss
        except psutil.Error:
            pass
    return rss, pss_total


def _run_engine(engine: str, args, model_path: str, adapters: list[str], tmp: Path) -> dict:
    import psutil
    from tqdm import tqdm

    out, status, logf = tmp / f"{engine}.json", tmp / f"{engine}.status", tmp / f"{engine}.log"
    cmd = [sys.executable, "-m", "collab_app.commands.bench", "_worker", "--engine", engine, "--model-path", model_path,
           "--out", str(out), "--status", str(status), "--dtype", args.dtype, "--prompts", str(args.prompts),
           "--num-generations", str(args.num_generations), "--max-new-tokens", str(args.max_new_tokens),
           "--temperature", str(args.temperature), "--max-model-len", str(args.max_model_len)]
    cmd += ["--adapters", *adapters] if adapters else []
    cmd += ["--base-too"] if args.base_too else []
    cmd += ["--hf-threads", str(args.hf_threads), "--rounds", str(args.rounds), "--lora-rank", str(args.lora_rank),
            "--think-s", str(args.think_s)]
    cmd += ["--beside-training"] if args.beside_training else []
    peak = peak_pss = 0
    with open(logf, "w") as log, tqdm(desc=engine, bar_format="{desc}: {elapsed} {postfix}", file=sys.stderr,
                                      mininterval=1 if sys.stderr.isatty() else 30) as bar:
        # an engine's worker serves as `collab serve` does (huge pages unless the environment says
        # otherwise); the baseline keeps torch's 4 KiB pages, as a reader's transformers has them
        # (cpu/huge_pages.py)
        env = {**os.environ, THP_VAR: "0"} if engine == "plain" else {THP_VAR: "1", **os.environ}
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        proc = psutil.Process(child.pid)
        tick = 0
        while child.poll() is None:
            rss, pss = _tree_memory(proc, pss=tick % 4 == 0)
            peak, peak_pss, tick = max(peak, rss), max(peak_pss, pss), tick + 1
            phase = status.read_text() if status.exists() else "launching"
            bar.set_postfix_str(f"{phase}, peak rss {peak / 1e9:.2f} GB", refresh=False)
            bar.update(0)
            time.sleep(0.25)
    if child.returncode != 0 or not out.exists():
        tail = logf.read_text().strip().splitlines()[-15:]
        return {"error": f"exit {child.returncode}; log {logf}:\n" + "\n".join(tail)}
    return {**json.loads(out.read_text()), "peak_rss_gb": round(peak / 1e9, 2), "peak_pss_gb": round(peak_pss / 1e9, 2)}


def _generate(args) -> int:
    from trainer.dtypes import cpu_capability
    from collab_app.engines.model import ensure_model

    model_path = ensure_model(args.model)
    keep = Path(args.keep) if args.keep else None
    with tempfile.TemporaryDirectory(prefix="collab-bench-") as td:
        tmp = keep or Path(td)
        tmp.mkdir(parents=True, exist_ok=True)
        adapters = [] if args.no_adapters else [
            make_random_lora(model_path, tmp / f"lora-{k}", seed=k, r=args.lora_rank, scale=args.lora_scale)
            for k in (1, 2)]
        res = {e: _run_engine(e, args, model_path, adapters, tmp) for e in args.engines}
        limit = floor(model_path, args.max_new_tokens, read_bandwidth_gbs())   # nothing else running now
    report = {
        "workload": {"num_agents": 2, "engine_slots": engine_race.serve_slots(), "engine_lora_lanes": engine_race.serve_lanes(),
                     "prompts": args.prompts, "num_generations": args.num_generations,
                     "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "dtype": args.dtype,
                     "adapters": not args.no_adapters, "lora_rank": args.lora_rank, "lora_scale": args.lora_scale,
                     "interactive": f"1 prompt x 2 agents x G={args.num_generations}, streamed, median of {args.rounds}",
                     "hf_threads": args.hf_threads or "torch default", "think_s": args.think_s},
        "machine": {"cpus": os.cpu_count(), "cpu_capability": cpu_capability(), "gpu": _gpu_name(),
                    "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
        "engines": res,
        "floor": limit,
    }
    ok = {e: r for e, r in res.items() if "error" not in r}
    if "vllm" in ok and "transformers" in ok:
        report["ratio_round_s_vllm_over_transformers"] = round(
            ok["vllm"]["interactive"]["round_s"] / ok["transformers"]["interactive"]["round_s"], 2)
    for e in (*VLLM_VARIANTS, *HF_VARIANTS):
        if e in ok and "plain" in ok:
            report[f"ratio_round_s_{e}_over_plain"] = round(
                ok[e]["interactive"]["round_s"] / ok["plain"]["interactive"]["round_s"], 2)
    if "vllm" in ok and "remote" in ok:
        report["ratio_round_s_remote_over_vllm"] = round(
            ok["remote"]["interactive"]["round_s"] / ok["vllm"]["interactive"]["round_s"], 2)
        if args.prompts:
            report["ratio_tokens_per_s_remote_over_vllm"] = round(
                ok["remote"]["tokens_per_s"] / ok["vllm"]["tokens_per_s"], 2)
    if "vllm" in ok and "transformers" in ok and args.prompts:
        report["ratio_vllm_over_transformers"] = round(ok["vllm"]["tokens_per_s"] / ok["transformers"]["tokens_per_s"], 2)
        if "base" in ok["vllm"] and "base" in ok["transformers"]:
            report["ratio_base_vllm_over_transformers"] = round(
                ok["vllm"]["base"]["tokens_per_s"] / ok["transformers"]["base"]["tokens_per_s"], 2)
    print(json.dumps(report, indent=1) if args.json else _table(report))
    return 0 if len(ok) == len(res) else 1


def _gpu_name() -> str | None:
    """The CUDA GPU the engines ran on, or None (a CPU-only machine)."""
    from collab_app.engines.device import cuda_available

    if not cuda_available():
        return None
    import torch

    return torch.cuda.get_device_name(0)


def _table(report: dict) -> str:
    res = report["engines"]
    names = list(res)
    lines = [f"{'':<22}" + "".join(f"{n:>14}" for n in names)]
    for label, part, key in (("dtype", None, "dtype"), ("base GEMMs", None, "quantize"),
                             ("first text s", "interactive", "first_text_s"),
                             ("round s", "interactive", "round_s"),
                             ("first text s (train)", "interactive_beside_training", "first_text_s"),
                             ("round s (train)", "interactive_beside_training", "round_s"),
                             ("round s (no pause)", "interactive_beside_training_no_pause", "round_s")):
        vals = [(res[n].get(part, {}) if part else res[n]).get(key, "-") for n in names]
        if any(v != "-" for v in vals):
            lines.append(f"{label:<22}" + "".join(f"{str(v):>14}" for v in vals))
    rows = [("tokens/s" + (" (adapters)" if report["workload"]["adapters"] else ""), "tokens_per_s"),
            ("tokens", "tokens"), ("generate s", "gen_s"), ("start-up s", "startup_s"), ("peak RSS GB", "peak_rss_gb"),
            ("peak PSS GB", "peak_pss_gb")]
    for label, key in rows:
        lines.append(f"{label:<22}" + "".join(f"{str(res[n].get(key, '-')):>14}" for n in names))
    if any("base" in r for r in res.values()):
        lines.append(f"{'tokens/s (base)':<22}" + "".join(f"{str(res[n].get('base', {}).get('tokens_per_s', '-')):>14}" for n in names))
    f = report.get("floor")
    if f:
        lines.append(f"{'floor round s':<22}fp32 {f['round_s_fp32']} / fp16 {f.get('round_s_fp16')} / int8 {f['round_s_int8']} "
                     f"({f['weight_gb_fp32']} / {f.get('weight_gb_fp16')} / {f['weight_gb_int8']} GB of weights x "
                     f"{report['workload']['max_new_tokens']} "
                     f"steps at {f['bandwidth_gbs']} GB/s, one core's measured read bandwidth)")
    for key in (*(k for k in report if k.startswith("ratio_round_s_") and k.endswith("_over_plain")),
                "ratio_round_s_vllm_over_transformers", "ratio_vllm_over_transformers",
                "ratio_base_vllm_over_transformers",
                "ratio_round_s_remote_over_vllm", "ratio_tokens_per_s_remote_over_vllm"):
        if key in report:
            lines.append(f"{key}: {report[key]}")
    lines += [f"{n} failed: {r['error']}" for n, r in res.items() if "error" in r]
    w = report["workload"]
    lines.append(f"(interactive: {w['interactive']}; rollout: 2 agents x {w['prompts']} prompts x G={w['num_generations']}; "
                 f"{w['max_new_tokens']} new tokens, T={w['temperature']}, dtype {w['dtype']}, LoRA r={w['lora_rank']} "
                 f"x{w['lora_scale']}; CPU {report['machine']['cpu_capability']}; load avg {report['machine']['load_avg_1m_at_end']})")
    return "\n".join(lines)


def cli_main(argv: list[str]) -> int:
    if argv and argv[0] == "train":
        from collab_app.commands.bench_train import run

        return int(run(argv[1:]) or 0)
    if argv and argv[0] == "online":
        from collab_app.commands.bench_online import cli_main as online

        return int(online(argv[1:]) or 0)
    if argv and argv[0] == "comlrl":
        from collab_app.commands.bench_comlrl import cli_main as comlrl

        return int(comlrl(argv[1:]) or 0)
    if argv and argv[0] == "page":
        from collab_app.commands.bench_page import cli_main as page

        return int(page(argv[1:]) or 0)
    if argv and argv[0] == "abuse":
        from collab_app.commands.bench_abuse import cli_main as abuse

        return int(abuse(argv[1:]) or 0)
    if argv and argv[0] == "faults":
        from collab_app.commands.bench_faults import cli_main as faults

        return int(faults(argv[1:]) or 0)
    if argv and argv[0] == "arena":
        from collab_app.commands.bench_arena import cli_main as arena

        return int(arena(argv[1:]) or 0)
    p = argparse.ArgumentParser(prog="collab bench", description="benchmarks: `generate` (vLLM vs transformers), "
                                "`train` (MAGRPO step), `online` (scripted raters against `collab serve`), "
                                "`comlrl` (PyPI comlrl's MAGRPO at a wall-clock budget), `page` (a person's round in headless "
                                "Chromium next to the API), `abuse` (one network with many identities against honest raters), "
                                "`faults` (scripted raters while faults are injected), `arena` (a scripted voter "
                                "ranks trained team states through /v1/arena)")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="same team workload through each engine, side by side")
    g.add_argument("--engines", nargs="+", default=["vllm", "transformers", "plain"],
                   choices=[*VLLM_VARIANTS, *HF_VARIANTS, "plain", "remote"],
                   help="vllm = the engine as the app serves it (dtype and base GEMMs by this machine's calibration, "
                        "compiled where the engine race found that faster here, and under --beside-training decoding on "
                        "the trainer's cores between its steps, as serve's borrow_cores); vllm-eager = the same, never "
                        "compiled; vllm-noborrow = the same without borrowing (serve --no-borrow-cores); "
                        "vllm-spawn = the same with vLLM's engine core and worker in two spawned processes; "
                        "vllm-compiled = compiled whatever the race found; "
                        "vllm-onednn = vLLM's own base GEMMs (no fp16/int8 swap); transformers-torch = the transformers engine with torch's own GEMMs; vllm-fp16 / vllm-int8 = base GEMMs "
                        "with fp16 weights / dynamic int8 (VLLMEngine quantize=...); plain = eager "
                        "transformers fp32 model.generate on the interactive round's rows, no adapters (the baseline); "
                        "remote = a vLLM OpenAI-compatible server started here, used over HTTP (--engine-url)")
    g.add_argument("--model", default=None, help="HF id / folder (default: embedded SmolLM2)")
    g.add_argument("--prompts", type=int, default=16, help="rollout workload prompts (0 = interactive only)")
    g.add_argument("--num-generations", type=int, default=4)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto = bf16 where the CPU/GPU has it natively, else fp32 (trainer/dtypes.py)")
    g.add_argument("--rounds", type=int, default=3, help="interactive rounds (1 prompt, G per agent) to take the median of")
    g.add_argument("--beside-training", action="store_true",
                   help="also time the interactive rounds while a MAGRPO update loop runs (training_load.training_load)")
    g.add_argument("--think-s", type=float, default=0.0,
                   help="seconds before each interactive round, as a person reads the last (0 = back to back)")
    g.add_argument("--lora-scale", type=float, default=2.0, help="multiply the random LoRA weights (2: outputs clearly differ)")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--lora-rank", type=int, default=8)
    g.add_argument("--no-adapters", action="store_true", help="base model only (no LoRA)")
    g.add_argument("--base-too", action="store_true", help="also time the base model after the adapter run")
    g.add_argument("--hf-threads", type=int, default=0,
                   help="torch threads for the transformers engine (0 = torch default, all cores)")
    g.add_argument("--keep", default=None, help="keep adapters, logs and per-engine JSON in this folder")
    g.add_argument("--json", action="store_true")
    sub.add_parser("train", help="MAGRPO training-step benchmark (collab_app.commands.bench_train; own options)")
    sub.add_parser("online", help="scripted raters with declared preferences against a running `collab serve` "
                                  "(collab_app.commands.bench_online; own options)")
    sub.add_parser("comlrl", help="PyPI comlrl's MAGRPOTrainer on our task for --max-minutes, evaluated before/after "
                                  "(collab_app.commands.bench_comlrl; own options; needs the `compare` extra)")
    sub.add_parser("page", help="a person's round timed in the real page (headless Chromium) next to the same rounds "
                                "through the API, quiet and beside a MAGRPO step (collab_app.commands.bench_page; own options)")
    sub.add_parser("abuse", help="one network with many identities rating to push a preference beside honest raters "
                                 "on other networks, against a real `collab serve` behind a trusted proxy hop "
                                 "(collab_app.commands.bench_abuse; own options)")
    sub.add_parser("faults", help="scripted raters against a real `collab serve` while faults are injected: a full "
                                  "disk, the trainer killed mid-step, a locked store, wiped adapters, a clock step, "
                                  "a truncated adapter (collab_app.commands.bench_faults; own options)")
    sub.add_parser("arena", help="a scripted rater trains a real `collab serve`, then a scripted voter with the same "
                                 "preference votes blind pairs through /v1/arena: votes to separate two states, "
                                 "Kendall's tau of step order vs board (collab_app.commands.bench_arena; own options)")
    w = sub.add_parser("_worker")  # internal: one engine in its own process
    w.add_argument("--engine", required=True)
    w.add_argument("--model-path", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--status", required=True)
    w.add_argument("--adapters", nargs="*", default=[])
    w.add_argument("--base-too", action="store_true")
    w.add_argument("--hf-threads", type=int, default=0)
    w.add_argument("--rounds", type=int, default=3)
    w.add_argument("--lora-rank", type=int, default=8)
    w.add_argument("--beside-training", action="store_true")
    w.add_argument("--think-s", type=float, default=0.0)
    for name, typ in (("--dtype", str), ("--prompts", int), ("--num-generations", int), ("--max-new-tokens", int),
                      ("--temperature", float), ("--max-model-len", int)):
        w.add_argument(name, type=typ, required=True)
    args = p.parse_args(argv)
    if args.cmd == "generate" and args.think_s < 0:
        p.error(f"--think-s must be >= 0 (seconds before each interactive round), got {args.think_s}")
    if args.cmd == "_worker":
        _worker(args)
        return 0
    return _generate(args)


if __name__ == "__main__":  # the worker runs as `python -m collab_app.commands.bench _worker`; vLLM spawns
    sys.exit(cli_main(sys.argv[1:]))

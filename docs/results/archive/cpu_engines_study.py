"""Issue 19 item 3: whole CPU decode engines side by side on the interactive round (measured study).

Experiment code, not part of the app. Runs in its OWN venv (the candidates' wheels must not enter
the project's): python3 -m venv /tmp/ovenv; /tmp/ovenv/bin/pip install torch==2.13.0; then
/tmp/ovenv/bin/pip install openvino-genai "optimum-intel[openvino]" nncf ctranslate2 onnxruntime-genai
peft "transformers<5.20"; pin torch back to 2.13.0 if a package pulled another.

Workload = the project's interactive round: one prompt (67 tokens: the helper role's system
prompt + a task of two sentences, SmolLM2's chat template), 2 agents (each a random peft LoRA, r=8 on
q/k/v/o, made by collab_app.commands.bench.make_random_lora) x G=4 rows x 128 new tokens (EOS
ignored / min_new_tokens=128), T=0.8 sampling. One warm-up round, then 3 timed rounds: median
seconds per round and tok/s (tokens actually generated / wall time).

    python cpu_engines_study.py prep  --work W          # adapters, merged folders, exports, conversions
    python cpu_engines_study.py run CANDIDATE --work W --mode native|avx2 --out FILE.json
    python cpu_engines_study.py gaps  --work W --mode native --out FILE.json   # teacher-forced log-prob gaps
    python cpu_engines_study.py gaps-text --work W --out FILE.json   # the same on calibrate.py's fixed text
    python cpu_engines_study.py collect --work W --out docs/results/cpu-engines-study.json

--mode avx2 only records the label: the caller sets the environment (ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 CT2_FORCE_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2), and OpenVINO
candidates force INFERENCE_PRECISION_HINT=f32 there (bf16 has no native path on AVX2).
Every CPU-heavy call was run under `flock /tmp/collab-cpu.lock` (a shared 2-core box).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

ROWS_PER_AGENT, AGENTS, NEW, TEMP, ROUNDS = 4, 2, 128, 0.8, 3
if os.environ.get("STUDY_SMOKE"):   # a few tokens, to check that a candidate runs at all (no figures)
    NEW, ROUNDS = 4, 1
SYSTEM = "You write one small Python helper function for the task. Code only."
USER = ("Task: reverse the words of a sentence. Write the function with type hints and a one-line docstring, "
        "keep punctuation attached to its word, and return an empty string for empty input.")
CANDIDATES = ["ov-fp32", "ov-bf16", "ov-int8-f32", "ov-int8-bf16", "ov-int8-cb-mixed",
              "ct2-float32", "ct2-int8", "ct2-int8_float32", "ct2-bfloat16", "ct2-int8_bfloat16",
              "ortgenai-fp32", "ortgenai-int4", "hf-compile"]


def model_path() -> str:
    from collab_app.engines.model import ensure_model
    return ensure_model()


def prompt_ids(tok) -> list[int]:
    return tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                                   add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def machine() -> dict:
    import torch
    flags = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = line
            break
    name = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")), platform.processor())
    keep = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_tile", "fma")
    return {"cpu": name, "cores": os.cpu_count(), "flags": [f for f in keep if f" {f}" in flags],
            "torch": torch.__version__, "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "CT2_FORCE_CPU_ISA",
                                               "MKL_ENABLE_INSTRUCTIONS") if k in os.environ}}


# -- prep ------------------------------------------------------------------------------------------
def merge(base: str, adapter: str, out: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    m = PeftModel.from_pretrained(m, adapter).merge_and_unload()
    m.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)


def sh(cmd: list[str], log: dict) -> bool:
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    log[" ".join(cmd)] = {"rc": p.returncode, "s": round(time.perf_counter() - t, 1),
                          "tail": (p.stdout + p.stderr)[-1500:] if p.returncode else ""}
    print(" ".join(cmd), "->", p.returncode, flush=True)
    return p.returncode == 0


def prep(work: Path, steps: list[str]) -> None:
    from collab_app.commands.bench import make_random_lora
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    work.mkdir(parents=True, exist_ok=True)
    base = model_path()
    log = json.loads((work / "prep.json").read_text()) if (work / "prep.json").exists() else {}
    bin_ = Path(sys.executable).parent
    if "adapters" in steps:
        for k, name in enumerate(("helper", "main")):   # as collab bench generate: r=8, weights x2
            make_random_lora(base, work / f"lora-{name}", seed=k, r=8, scale=2.0)
            merge(base, str(work / f"lora-{name}"), work / f"merged-{name}")
        # an fp32 copy of the base (the checkpoint is bf16 on disk) for the exporters
        m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        m.save_pretrained(work / "base-fp32")
        AutoTokenizer.from_pretrained(base).save_pretrained(work / "base-fp32")
    if "openvino" in steps:
        src = str(work / "base-fp32")
        sh([str(bin_ / "optimum-cli"), "export", "openvino", "-m", src, "--task", "text-generation-with-past",
            "--weight-format", "fp32", str(work / "ov-fp32")], log)
        sh([str(bin_ / "optimum-cli"), "export", "openvino", "-m", src, "--task", "text-generation-with-past",
            "--weight-format", "int8", str(work / "ov-int8")], log)
    if "ct2" in steps:
        for name in ("helper", "main"):
            sh([str(bin_ / "ct2-transformers-converter"), "--model", str(work / f"merged-{name}"),
                "--output_dir", str(work / f"ct2-{name}"), "--force"], log)
    if "ortgenai" in steps:
        for prec in ("fp32", "int4"):
            sh([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", "HuggingFaceTB/SmolLM2-135M-Instruct",
                "-i", str(work / "base-fp32"), "-o", str(work / f"ortgenai-{prec}"), "-p", prec, "-e", "cpu",
                "-c", str(work / "ort-cache")], log)
    (work / "prep.json").write_text(json.dumps(log, indent=1))


# -- candidates: each returns round(k) -> (rows of generated token ids) --------------------------
def cand_openvino(name: str, work: Path, mode: str, tok, ids: list[int]):
    import numpy as np
    import openvino as ov
    import openvino_genai as og
    weights = "int8" if "int8" in name else "fp32"
    prec = "bf16" if name.endswith("bf16") and mode == "native" else "f32"
    props = {"INFERENCE_PRECISION_HINT": prec, "INFERENCE_NUM_THREADS": os.cpu_count()}
    adapters = {a: og.Adapter(str(work / f"lora-{a}" / "adapter_model.safetensors")) for a in ("helper", "main")}
    # peft scale = lora_alpha / r = 2 (make_random_lora: alpha = 2r); OpenVINO's alpha multiplies B·A
    cfg_all = og.AdapterConfig()
    for a in adapters.values():
        cfg_all.add(a, 0.0)
    info = {"inference_precision": prec, "weights": weights, "props": props}

    def gcfg(agent: str | None, greedy=False):
        c = og.GenerationConfig()
        c.max_new_tokens = NEW
        c.min_new_tokens = NEW
        c.ignore_eos = True
        c.do_sample = not greedy
        if not greedy:
            c.temperature, c.top_p = TEMP, 1.0   # top_k left at its default (off)
        c.apply_chat_template = False
        c.logprobs = 1
        if agent is not None:
            ac = og.AdapterConfig()
            for a, ad in adapters.items():
                ac.add(ad, 2.0 if a == agent else 0.0)
            c.adapters = ac
        return c

    text = tok.decode(ids)
    if name.endswith("cb-mixed"):
        # ContinuousBatchingPipeline: per-request configs, both agents' rows in ONE generate call
        sched = og.SchedulerConfig()
        sched.cache_size = 1
        pipe = og.ContinuousBatchingPipeline(str(work / f"ov-{weights}"), sched, "CPU", {**props, "adapters": cfg_all})
        info["backend"] = "ContinuousBatchingPipeline, per-request adapters, both agents' rows in one generate call"

        def one_round(greedy=False):
            x = ov.Tensor(np.array([ids], dtype=np.int64))
            cfgs = [gcfg(a, greedy) for a in ("helper", "main") for _ in range(ROWS_PER_AGENT)]
            res = pipe.generate([x] * len(cfgs), cfgs)
            return [list(r.m_generation_ids[0]) for r in res], res
    else:
        pipe = og.LLMPipeline(str(work / f"ov-{weights}"), "CPU", adapters=cfg_all, **props)
        info["backend"] = "LLMPipeline (continuous batching scheduler), one call per agent"

        def one_round(greedy=False):
            rows = []
            for a in ("helper", "main"):
                inp = og.TokenizedInputs(ov.Tensor(np.array([ids] * ROWS_PER_AGENT, dtype=np.int64)),
                                         ov.Tensor(np.ones((ROWS_PER_AGENT, len(ids)), dtype=np.int64)))
                r = pipe.generate(inp, gcfg(a, greedy))
                rows.extend([list(t) for t in r.tokens])
            return rows, None
    return one_round, info


def cand_ct2(name: str, work: Path, mode: str, tok, ids: list[int]):
    import ctranslate2
    ct = name.split("-", 1)[1]
    gens = {a: ctranslate2.Generator(str(work / f"ct2-{a}"), device="cpu", compute_type=ct,
                                     intra_threads=os.cpu_count()) for a in ("helper", "main")}
    toks = tok.convert_ids_to_tokens(ids)
    info = {"compute_type": ct, "backend": "two Generators (merged weights per agent), one generate_batch each",
            "ct2_isa_env": os.environ.get("CT2_FORCE_CPU_ISA")}

    def one_round(greedy=False):
        rows = []
        for a in ("helper", "main"):
            res = gens[a].generate_batch([toks] * ROWS_PER_AGENT, max_length=NEW, min_length=NEW,
                                         sampling_topk=1 if greedy else 0, sampling_temperature=TEMP,
                                         include_prompt_in_result=False)
            rows.extend([list(r.sequences_ids[0]) for r in res])
        return rows, None
    return one_round, info


def cand_ortgenai(name: str, work: Path, mode: str, tok, ids: list[int]):
    import numpy as np
    import onnxruntime_genai as og
    model = og.Model(str(work / name))
    info = {"backend": "onnxruntime-genai, base weights (no adapter: multi-LoRA needs .onnx_adapter files)"}

    def one_round(greedy=False):
        params = og.GeneratorParams(model)
        n = AGENTS * ROWS_PER_AGENT
        params.set_search_options(max_length=len(ids) + NEW, min_length=len(ids) + NEW, do_sample=not greedy,
                                  temperature=TEMP, top_k=1 if greedy else 49152, top_p=1.0, batch_size=n)
        g = og.Generator(model, params)
        g.append_tokens(np.array([ids] * n, dtype=np.int32))
        while not g.is_done():
            g.generate_next_token()
        return [[int(t) for t in g.get_sequence(i)][len(ids):] for i in range(n)], None
    return one_round, info


def cand_hf_compile(name: str, work: Path, mode: str, tok, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(work / "merged-helper"), dtype=torch.float32).eval()
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, dynamic=False)
    info = {"backend": "transformers fp32, static cache, torch.compile(model.forward) default mode, one merged "
                       "model, 8 rows in one generate (upper bound: no per-agent weights)"}
    x = torch.tensor([ids] * (AGENTS * ROWS_PER_AGENT))

    def one_round(greedy=False):
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=not greedy, temperature=TEMP,
                                 top_k=0, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=tok.eos_token_id)
        return out[:, len(ids):].tolist(), None
    return one_round, info


def run(name: str, work: Path, mode: str, out: Path) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(work / "base-fp32"))
    ids = prompt_ids(tok)
    rec = {"candidate": name, "mode": mode, "machine": machine(), "prompt_tokens": len(ids),
           "load_avg_before": os.getloadavg()}
    t = time.perf_counter()
    try:
        if name.startswith("ov-"):
            one_round, info = cand_openvino(name, work, mode, tok, ids)
        elif name.startswith("ct2-"):
            one_round, info = cand_ct2(name, work, mode, tok, ids)
        elif name.startswith("ortgenai-"):
            one_round, info = cand_ortgenai(name, work, mode, tok, ids)
        elif name == "hf-compile":
            one_round, info = cand_hf_compile(name, work, mode, tok, ids)
        else:
            raise SystemExit(f"unknown candidate {name}")
        rec.update(info)
        rec["startup_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        rows, _ = one_round()                       # warm-up
        rec["warmup_s"] = round(time.perf_counter() - t, 2)
        times, ntok = [], []
        for _ in range(ROUNDS):
            t = time.perf_counter()
            rows, _ = one_round()
            times.append(time.perf_counter() - t)
            ntok.append(sum(len(r) for r in rows if r is not None))
        rec["load_avg_after"] = os.getloadavg()
        med = statistics.median(times)
        rec.update({"round_s": round(med, 2), "rounds_s": [round(x, 2) for x in times], "tokens_per_round": ntok,
                    "tok_s": round(statistics.median(ntok) / med, 1)})
        # exactness probe: greedy rows of each agent (compared with transformers+peft by `gaps`)
        grows, _ = one_round(greedy=True)
        rec["greedy_rows"] = {"helper": grows[0], "main": grows[ROWS_PER_AGENT]} if grows and grows[0] is not None else None
        rec["sample_text"] = tok.decode(rows[0][:40]) if rows and rows[0] is not None else None
    except Exception as e:  # noqa: BLE001 - the study records the exact error
        import traceback
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()[-2000:]
    out.write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: v for k, v in rec.items() if k not in ("greedy_rows", "traceback", "machine")}))


# -- teacher-forced log-prob gaps ------------------------------------------------------------------
def gaps(work: Path, mode: str, out: Path, which: list[str]) -> None:
    """Rows: 8 x 128 tokens sampled (T=0.8, seed 0) by fp32 transformers from the model under test
    (base for OpenVINO, agent 'helper' merged for CTranslate2), then teacher-forced through the
    variant's forward and through fp32 transformers: |Δ log p| of every generated token (mean, max),
    as engines/calibrate.py does on its fixed text. Also: greedy token equality of each candidate's
    run (greedy_rows in its run JSON) with transformers+peft fp32."""
    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(work / "base-fp32"))
    ids = prompt_ids(tok)
    P = len(ids)
    res = {"mode": mode, "machine": machine(), "method": gaps.__doc__}

    def ref_rows(folder: str):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        x = torch.tensor([ids] * 8)
        with torch.no_grad():
            seq = m.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=TEMP, top_k=0,
                             max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=tok.eos_token_id)
            lp = torch.log_softmax(m(seq).logits[:, P - 1:-1].float(), -1).gather(2, seq[:, P:, None])[..., 0]
        return seq, lp

    def stat(a, b):
        d = (np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).__abs__()
        return {"mean": round(float(d.mean()), 4), "max": round(float(d.max()), 4), "tokens": int(d.size)}

    if any(w.startswith("ov") for w in which):
        from optimum.intel import OVModelForCausalLM
        seq, ref = ref_rows(str(work / "base-fp32"))
        for w in [w for w in which if w.startswith("ov")]:
            weights, prec = ("int8" if "int8" in w else "fp32"), ("bf16" if w.endswith("bf16") else "f32")
            m = OVModelForCausalLM.from_pretrained(str(work / f"ov-{weights}"), ov_config={
                "INFERENCE_PRECISION_HINT": prec}, compile=True)
            with torch.no_grad():
                lg = m(input_ids=seq, attention_mask=torch.ones_like(seq)).logits
            lp = torch.log_softmax(torch.as_tensor(lg)[:, P - 1:-1].float(), -1).gather(2, seq[:, P:, None])[..., 0]
            res[w] = stat(lp.numpy(), ref.numpy())
            print(w, res[w], flush=True)
    if any(w.startswith("ct2") for w in which):
        import ctranslate2
        seq, ref = ref_rows(str(work / "merged-helper"))
        toks = [tok.convert_ids_to_tokens(r) for r in seq.tolist()]
        for w in [w for w in which if w.startswith("ct2")]:
            g = ctranslate2.Generator(str(work / "ct2-helper"), device="cpu", compute_type=w.split("-", 1)[1])
            sc = g.score_batch(toks)
            lp = np.array([r.log_probs[P - 1:] for r in sc])   # log_probs[i] = log p(token i+1)
            res[w] = stat(lp, ref.numpy())
            print(w, res[w], flush=True)
    if "greedy" in which:   # transformers+peft fp32 greedy rows, per agent, for the exactness probe
        base = AutoModelForCausalLM.from_pretrained(str(work / "base-fp32"), dtype=torch.float32).eval()
        x = torch.tensor([ids])
        g = {}
        for a in ("helper", "main"):
            pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(work / "base-fp32"),
                                           dtype=torch.float32), str(work / f"lora-{a}")).eval()
            with torch.no_grad():
                o = pm.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                                min_new_tokens=NEW, pad_token_id=tok.eos_token_id)
            g[a] = o[0, P:].tolist()
        with torch.no_grad():
            o = base.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                              min_new_tokens=NEW, pad_token_id=tok.eos_token_id)
        g["base"] = o[0, P:].tolist()
        res["greedy_peft_fp32"] = g
    out.write_text(json.dumps(res, indent=1))


def gaps_text(work: Path, out: Path) -> None:
    """The cheap form of `gaps`: engines/calibrate.py's own method and fixed TEXT (~60 tokens), teacher-
    forced through each variant and through fp32 transformers: mean and max |Δ log p| per token.
    A few seconds of compute (no generation)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from collab_app.engines.calibrate import TEXT
    res = {"method": gaps_text.__doc__, "machine": machine()}
    tok = AutoTokenizer.from_pretrained(str(work / "base-fp32"))
    ids = torch.tensor([tok(TEXT)["input_ids"]])

    def ref(folder):
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            return torch.log_softmax(m(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]

    def stat(a, b):
        d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
        return {"mean": round(float(d.mean()), 4), "max": round(float(d.max()), 4), "tokens": int(d.size)}

    from optimum.intel import OVModelForCausalLM
    r0 = ref(str(work / "base-fp32"))
    for w, weights, prec in [("ov-fp32", "fp32", "f32"), ("ov-bf16", "fp32", "bf16"), ("ov-int8-f32", "int8", "f32"),
                             ("ov-int8-bf16", "int8", "bf16")]:
        m = OVModelForCausalLM.from_pretrained(str(work / f"ov-{weights}"), ov_config={"INFERENCE_PRECISION_HINT": prec})
        with torch.no_grad():
            lg = torch.as_tensor(m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits)
        res[w] = stat(torch.log_softmax(lg[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0], r0)
        print(w, res[w], flush=True)
    import ctranslate2
    r1 = ref(str(work / "merged-helper"))
    toks = [tok.convert_ids_to_tokens(ids[0].tolist())]
    for ct in ("float32", "int8", "int8_float32"):
        g = ctranslate2.Generator(str(work / "ct2-helper"), device="cpu", compute_type=ct)
        res["ct2-" + ct] = stat(g.score_batch(toks)[0].log_probs, r1)
        print(ct, res["ct2-" + ct], flush=True)
    out.write_text(json.dumps(res, indent=1))


def collect(work: Path, out: Path) -> None:
    recs = {p.stem: json.loads(p.read_text()) for p in sorted((work / "results").glob("*.json"))}
    ref = recs.get("gaps-greedy", {}).get("greedy_peft_fp32")
    if ref:
        for k, r in recs.items():
            if r.get("greedy_rows"):
                r["greedy_equal_to_peft_fp32"] = {
                    a: next((i for i, (x, y) in enumerate(zip(r["greedy_rows"][a], ref[a])) if x != y), "all 128 equal")
                    for a in ("helper", "main")}
    out.write_text(json.dumps({"study": __doc__.split("\n")[0], "results": recs,
                               "prep": json.loads((work / "prep.json").read_text()) if (work / "prep.json").exists()
                               else None}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["prep", "run", "gaps", "gaps-text", "collect"])
    ap.add_argument("candidate", nargs="?")
    ap.add_argument("--work", type=Path, default=Path("/tmp/study/work"))
    ap.add_argument("--mode", default="native")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps", default="adapters,openvino,ct2,ortgenai")
    ap.add_argument("--which", default="ov-fp32,ov-bf16,ov-int8-f32,ov-int8-bf16,ct2-float32,ct2-int8,"
                                       "ct2-int8_float32,greedy")
    a = ap.parse_args()
    if a.cmd == "prep":
        prep(a.work, a.steps.split(","))
    elif a.cmd == "run":
        run(a.candidate, a.work, a.mode, a.out)
    elif a.cmd == "gaps":
        gaps(a.work, a.mode, a.out, a.which.split(","))
    elif a.cmd == "gaps-text":
        gaps_text(a.work, a.out)
    else:
        collect(a.work, a.out)


if __name__ == "__main__":
    main()

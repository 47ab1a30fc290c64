"""GPU decomposition of the transformers engine's decode step (random 135M-shaped weights).

Run from the repository root on a CUDA machine with torch, transformers and peft (no vLLM needed),
after copying the embedded model's config and tokenizer files (not its weights: the model here
has random weights of the 135M shapes; decode time depends on shapes, not values) into
.gpu_run/m135/:  mkdir -p .gpu_run/m135 && cp $COLLAB_HOME/models/smollm2-135m-instruct/*.j* .gpu_run/m135/
then  OUT=docs/results python docs/results/archive/gpu_engine_decomposition_1.py   ->  gpu-h200-engine-decomposition-1.json / gpu-h200-engine-profile-1.txt
(docs/results/README.md, "On a GPU"). Ran on commit 5a0b7ac (per-slice LoRA hooks, generate on a thread of its own).
"""
import cProfile, io, json, os, pstats, shutil, sys, time
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessorList
sys.path.insert(0, os.getcwd())
from collab_app.engines.engine_hf import TransformersEngine, team_lora, SampledLogprobs
from collab_app.engines.engine_types import Request, Sampling
from collab_app.commands.bench import make_random_lora

OUT = os.environ.get("OUT", "/tmp/out")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
NT = 4 if os.environ.get("SMOKE") else 128
src, mdir = ".gpu_run/m135", "/tmp/m135"
cfg = AutoConfig.from_pretrained(src)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
m.save_pretrained(mdir)
for f in os.listdir(src):
    if not f.endswith(".json") or f == "config.json":
        shutil.copy(os.path.join(src, f), mdir)
    elif f != "config.json":
        shutil.copy(os.path.join(src, f), mdir)
del m
res = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none", "torch": torch.__version__}
eng = TransformersEngine(mdir, seed=0)
res["dtype"] = eng.dtype
ads = [make_random_lora(mdir, f"/tmp/lora{s}", s, r=8, scale=2.0) for s in (1, 2)]
eng.load_adapter("a", ads[0], 1); eng.load_adapter("b", ads[1], 1)
PROMPT = "Task: write a function that returns the sum of the squares of a list of numbers."
reqs = [Request("a", PROMPT), Request("b", PROMPT)]
S = Sampling(max_new_tokens=NT, temperature=0.8, seed=0)
def sync():
    if DEV == "cuda": torch.cuda.synchronize()
def timeit(fn, reps=3):
    ts = []
    for _ in range(reps):
        sync(); t = time.perf_counter(); fn(); sync(); ts.append(round(time.perf_counter() - t, 3))
    return sorted(ts)[len(ts) // 2], ts
def stream_all():
    for _ in eng.generate_stream(reqs, 4, S):
        pass
eng.generate(reqs, 4, S)   # warm
res["engine_generate_s"] = timeit(lambda: eng.generate(reqs, 4, S))
res["engine_stream_s"] = timeit(stream_all)
# the same rows by hand: ids of the engine's batch
from collab_app.engines import chat_prompt_ids
ids = chat_prompt_ids(eng.tokenizer, reqs[0])
batch = torch.tensor([ids] * 8, device=DEV); att = torch.ones_like(batch)
kw = dict(input_ids=batch, attention_mask=att, max_new_tokens=NT, min_new_tokens=NT, do_sample=True, temperature=0.8,
          top_p=1.0, top_k=0, pad_token_id=eng.tokenizer.pad_token_id, return_dict_in_generate=True)
names = ["a_"] * 4 + ["b_"] * 4
names = [eng._agents.served("a")[0]] * 4 + [eng._agents.served("b")[0]] * 4
peft = eng._peft
def raw(hooks=True, lp=False):
    k = dict(kw)
    if lp:
        k["logits_processor"] = LogitsProcessorList([SampledLogprobs()])
    with torch.inference_mode(), team_lora(peft, names if hooks else [None] * 8):
        peft.generate(**k)
res["peft_hooks_s"] = timeit(lambda: raw(True))
res["peft_hooks_logprobs_s"] = timeit(lambda: raw(True, True))
res["peft_nohooks_s"] = timeit(lambda: raw(False))
base = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.bfloat16).to(DEV).eval()
def plain():
    with torch.inference_mode():
        base.generate(**kw)
res["plain_bf16_s"] = timeit(plain)
# static cache + compiled forward (CUDA graphs), plain model: what the floor looks like
try:
    if os.environ.get("SMOKE"): raise RuntimeError("smoke")
    def plain_static():
        with torch.inference_mode():
            base.generate(**kw, cache_implementation="static")
    base.forward = torch.compile(base.forward, mode="reduce-overhead", fullgraph=False)
    t = time.perf_counter(); plain_static(); res["plain_static_compile_first_s"] = round(time.perf_counter() - t, 1)
    res["plain_static_compiled_s"] = timeit(plain_static)
except Exception as e:
    res["plain_static_error"] = f"{type(e).__name__}: {str(e)[:300]}"
print(json.dumps(res, indent=1), flush=True)
pr = cProfile.Profile(); pr.enable(); eng.generate(reqs, 4, S); sync(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); txt = s.getvalue()
print(txt[:6000])
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])) as prof:
    eng.generate(reqs, 4, S); sync()
tab = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
print(tab[:6000])
os.makedirs(OUT, exist_ok=True)
json.dump(res, open(f"{OUT}/gpu-h200-engine-decomposition-1.json", "w"), indent=1)
open(f"{OUT}/gpu-h200-engine-profile-1.txt", "w").write(txt + "\n\n" + tab)

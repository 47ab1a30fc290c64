"""Where the engine's extra time goes vs the same generate by hand; a fused LoRA-delta hook.

Run from the repository root on a CUDA machine with torch, transformers and peft (no vLLM needed),
after copying the embedded model's config and tokenizer files (not its weights: the model here
has random weights of the 135M shapes; decode time depends on shapes, not values) into
.gpu_run/m135/:  mkdir -p .gpu_run/m135 && cp $COLLAB_HOME/models/smollm2-135m-instruct/*.j* .gpu_run/m135/
then  OUT=docs/results python docs/results/archive/gpu_engine_decomposition_2.py   ->  gpu-h200-engine-decomposition-2.json
(docs/results/README.md, "On a GPU"). Ran on commit 5a0b7ac (per-slice LoRA hooks, generate on a thread of its own).
"""
import contextlib, functools, json, os, shutil, sys, threading, time
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessorList
sys.path.insert(0, os.getcwd())
from collab_app.engines import engine_hf
from collab_app.engines.engine_hf import TransformersEngine, team_lora, SampledLogprobs, row_segments
from collab_app.engines.engine_types import Request, Sampling
from collab_app.commands.bench import make_random_lora

OUT = os.environ.get("OUT", "/tmp/out")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
NT = 4 if os.environ.get("SMOKE") else 128
src, mdir = ".gpu_run/m135", "/tmp/m135"
if not os.path.exists(mdir + "/model.safetensors"):
    cfg = AutoConfig.from_pretrained(src)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m.save_pretrained(mdir)
    for f in os.listdir(src):
        if f != "config.json":
            shutil.copy(os.path.join(src, f), mdir)
    del m
res = {"gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "none"}


def _fused(A, B, mask, module, args, out):
    x = args[0]
    h = F.linear(x.to(A.dtype), A) * mask            # (rows, T, P*r): each row keeps its own agent's r columns, scaled
    out += F.linear(h, B).to(out.dtype)
    return out


@contextlib.contextmanager
def fused_team_lora(peft_model, names):
    if peft_model is None:
        yield; return
    from peft.tuners.lora import LoraLayer
    segments = row_segments(names)
    handles = []
    with peft_model.disable_adapter():
        try:
            for module in peft_model.modules():
                if not isinstance(module, LoraLayer):
                    continue
                As, Bs, spans = [], [], []
                col = 0
                for start, end, name in segments:
                    if name not in module.lora_A:
                        continue
                    a, b = module.lora_A[name].weight, module.lora_B[name].weight
                    As.append(a); Bs.append(b); spans.append((start, end, col, col + a.shape[0], module.scaling[name])); col += a.shape[0]
                if not As:
                    continue
                A = torch.cat(As); B = torch.cat(Bs, 1)
                mask = torch.zeros(len(names), 1, col, dtype=A.dtype)
                for s, e, c0, c1, sc in spans:
                    mask[s:e, :, c0:c1] = sc
                handles.append(module.register_forward_hook(functools.partial(_fused, A, B, mask.to(A.device))))
            yield
        finally:
            for h in handles:
                h.remove()


def sync():
    if DEV == "cuda": torch.cuda.synchronize()
def timeit(fn, reps=3):
    ts = []
    for _ in range(reps):
        sync(); t = time.perf_counter(); fn(); sync(); ts.append(round(time.perf_counter() - t, 3))
    return sorted(ts)[len(ts) // 2], ts

eng = TransformersEngine(mdir, seed=0)
ads = [make_random_lora(mdir, f"/tmp/lora{s}", s, r=8, scale=2.0) for s in (1, 2)]
eng.load_adapter("a", ads[0], 1); eng.load_adapter("b", ads[1], 1)
reqs = [Request("a", "Task: write a function that returns the sum of the squares of a list of numbers.")] * 1 + \
       [Request("b", "Task: write a function that returns the sum of the squares of a list of numbers.")]
S = Sampling(max_new_tokens=NT, temperature=0.8, seed=0)
captured = {}
real_generate = eng._peft.generate
def spy(**kw):
    captured.update(kw); return real_generate(**kw)
eng._peft.generate = spy
eng.generate(reqs, 4, S)
eng._peft.generate = real_generate
res["E1_engine"] = timeit(lambda: eng.generate(reqs, 4, S))
names = [eng._agents.served("a")[0]] * 4 + [eng._agents.served("b")[0]] * 4
kw = {k: v for k, v in captured.items() if k not in ("logits_processor",)}
res["kw"] = {k: (tuple(v.shape) if hasattr(v, "shape") else str(v)[:60]) for k, v in kw.items()}
def raw(ctx=team_lora):
    k = dict(kw, logits_processor=LogitsProcessorList([SampledLogprobs()]))
    with torch.inference_mode(), ctx(eng._peft, names):
        eng._peft.generate(**k)
res["E2_raw_main"] = timeit(raw)
def in_thread(fn):
    t = threading.Thread(target=fn); t.start(); t.join()
res["E3_raw_thread"] = timeit(lambda: in_thread(raw))
res["E4_raw_fused_main"] = timeit(lambda: raw(fused_team_lora))
res["E4b_raw_nohooks_main"] = timeit(lambda: raw(lambda p, n: team_lora(p, [None] * 8)))
engine_hf.team_lora = fused_team_lora
res["E5_engine_fused"] = timeit(lambda: eng.generate(reqs, 4, S))
# exactness of fused vs per-slice in fp32 on one forward
ids = kw["input_ids"][:, :20]
with torch.inference_mode():
    m32 = eng._peft.float()
    with team_lora(m32, names):
        l1 = m32(input_ids=ids).logits
    with fused_team_lora(m32, names):
        l2 = m32(input_ids=ids).logits
res["fp32_max_logit_diff"] = (l1 - l2).abs().max().item()
print(json.dumps(res, indent=1), flush=True)
os.makedirs(OUT, exist_ok=True)
json.dump(res, open(f"{OUT}/gpu-h200-engine-decomposition-2.json", "w"), indent=1)

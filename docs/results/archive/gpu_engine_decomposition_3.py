"""The transformers engine's round on a GPU again, and where a thread's generate loses time.

Run from the repository root on a CUDA machine with torch, transformers and peft (no vLLM needed),
after copying the embedded model's config and tokenizer files (not its weights: random weights of
the 135M shapes; decode time depends on shapes, not values) into .gpu_run/m135/:
  mkdir -p .gpu_run/m135 && cp $COLLAB_HOME/models/smollm2-135m-instruct/*.j* .gpu_run/m135/
then  OUT=docs/results python docs/results/archive/gpu_engine_decomposition_3.py  ->  gpu-h200-engine-decomposition-3.json
(ENGINE_ONLY=1: the engine's non-streamed and streamed rounds alone, twice  ->  ...-3-engine-only.json)
(docs/results/README.md, "On a GPU"). _1 and _2 timed commit 5a0b7ac; this one the engine as
`collab serve` builds it now (decode_thread=True: weights, batches and adapter loads on one thread
of the engine's own; team_lora's one fused hook per layer; rows sorted by agent).

What it times, median of 3 (seconds), 2 agents x G=4 = 8 rows x 128 tokens:
  engine_generate / engine_stream: the engine's non-streamed call and its streamed round (first
    words too), both on the decode thread;
  raw_main / raw_decoder / raw_fresh: the same `generate` call (same keywords, team_lora) by hand
    on the main thread, on the engine's decode thread, on a fresh thread per call;
  raw_fresh_1thread: a fresh thread that first sets torch.set_num_threads(1) (libgomp teams, the
    CPU finding of engine_hf's "Threads", as the cause or not);
  launch_*: 3000 small CUDA ops and one sync on each kind of thread (the per-launch cost alone).
"""
import json, os, shutil, sys, threading, time
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessorList
sys.path.insert(0, os.getcwd())
from collab_app.engines.engine_hf import TransformersEngine, team_lora, SampledLogprobs
from collab_app.engines.engine_types import Request, Sampling
from collab_app.engines.model import make_random_lora

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
res = {"gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "none", "torch": torch.__version__,
       "host_cores": os.cpu_count(), "torch_threads_main": torch.get_num_threads(), "load_avg": os.getloadavg()}


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timeit(fn, reps=3):
    ts = []
    for _ in range(reps):
        sync(); t = time.perf_counter(); fn(); sync(); ts.append(round(time.perf_counter() - t, 3))
    return sorted(ts)[len(ts) // 2], ts


eng = TransformersEngine(mdir, seed=0, decode_thread=True)     # as `collab serve` builds it
ads = [make_random_lora(mdir, f"/tmp/lora{s}", s, r=8, scale=2.0) for s in (1, 2)]
eng.load_adapter("a", ads[0], 1); eng.load_adapter("b", ads[1], 1)
prompt = "Task: write a function that returns the sum of the squares of a list of numbers."
reqs = [Request("a", prompt), Request("b", prompt)]
S = Sampling(max_new_tokens=NT, temperature=0.8, seed=0)
captured = {}
real_generate = eng._peft.generate
def spy(**kw):
    captured.update(kw); return real_generate(**kw)
eng._peft.generate = spy
eng.generate(reqs, 4, S)                                          # warm-up, and the keywords it uses
eng._peft.generate = real_generate
res["engine_generate"] = timeit(lambda: eng.generate(reqs, 4, S))
firsts = []
def stream():
    t = time.perf_counter(); first = None
    for p in eng.generate_stream(reqs, 4, S):
        if first is None and any(x for row in p.texts for x in row):
            first = time.perf_counter() - t
    firsts.append(round(first or -1, 3))
res["engine_stream"] = timeit(stream)
res["engine_stream_first_words"] = list(firsts)
names = [eng._agents.served("a")[0]] * 4 + [eng._agents.served("b")[0]] * 4
kw = {k: v for k, v in captured.items() if k not in ("logits_processor", "streamer", "stopping_criteria", "past_key_values")}
res["kw"] = {k: (tuple(v.shape) if hasattr(v, "shape") else str(v)[:60]) for k, v in kw.items()}
from collab_app.engines.engine_hf import chat_prompt_ids
prompts = eng.tokenizer.pad({"input_ids": [chat_prompt_ids(eng.tokenizer, r) for r in reqs]}, padding=True, return_tensors="pt")


def raw():
    """The engine's run() without its streamer: the shared prefill, then generate under team_lora."""
    k = dict(kw, logits_processor=LogitsProcessorList([SampledLogprobs()]))
    with torch.inference_mode():
        k["past_key_values"] = eng._shared_prefill(eng._peft, prompts, names[::4], 4,
                                                   prompts["input_ids"].shape[1] + k["max_new_tokens"])
        with team_lora(eng._peft, names):
            eng._peft.generate(**k)


def fresh(fn, threads=None):
    def body():
        if threads:
            torch.set_num_threads(threads)
        fn()
    t = threading.Thread(target=body); t.start(); t.join()


def save(name):
    print(json.dumps(res, indent=1), flush=True)
    os.makedirs(OUT, exist_ok=True)
    json.dump(res, open(f"{OUT}/{name}", "w"), indent=1)


def launches():
    x = torch.zeros(64, device=DEV)
    for _ in range(3000):
        x = x + 1
    sync()


if os.environ.get("ENGINE_ONLY"):   # the second call: the engine's two paths alone, after the streamer change
    res["engine_generate_again"] = timeit(lambda: eng.generate(reqs, 4, S))
    firsts.clear()
    res["engine_stream_again"] = timeit(stream)
    res["engine_stream_again_first_words"] = firsts
    save("gpu-h200-engine-decomposition-3-engine-only.json")
    sys.exit(0)
res["raw_main"] = timeit(raw)
res["raw_decoder"] = timeit(lambda: eng._decoder.submit(raw).result())
res["raw_fresh"] = timeit(lambda: fresh(raw))
res["raw_fresh_1thread"] = timeit(lambda: fresh(raw, 1))
res["launch_main"] = timeit(launches)
res["launch_decoder"] = timeit(lambda: eng._decoder.submit(launches).result())
res["launch_fresh"] = timeit(lambda: fresh(launches))
res["torch_threads_decoder"] = eng._decoder.submit(torch.get_num_threads).result()
# and the engine once more at the end: the machine's drift over the run
firsts.clear()
res["engine_stream_again"] = timeit(stream)
res["engine_stream_again_first_words"] = firsts
save("gpu-h200-engine-decomposition-3.json")

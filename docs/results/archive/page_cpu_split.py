"""Where the CPU goes during rounds in the page and through the API (collab bench page's two sides):
Chromium's processes, `collab serve`'s process and its children (the trainer), per round, with the
round's tokens (the store's) and the server's own time. HOME: a COLLAB_HOME with this machine's
calibration.json (a `collab bench page` run's home); ONLY=page: page rounds only.

    python docs/results/archive/page_cpu_split.py HOME ROUNDS     # from the repository root"""
import os, sys, time, subprocess, json, glob
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from collab_app.commands import bench_page as B
from collab_app.commands.bench_online import connect, start_server, stop_server, _free_port
from tasks import load_task
from collab_app.online.store import Store

home, rounds = sys.argv[1], int(sys.argv[2])
TCK = os.sysconf("SC_CLK_TCK")
def cpu(pid):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / TCK
    except OSError:
        return 0.0
def tree(root):
    out = subprocess.run(["pgrep", "-g", str(os.getpgid(root))], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]
def chromium_pids():
    out = subprocess.run(["pgrep", "-f", "/usr/lib/chromium/chromium"], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]
def threads(pid):
    res = {}
    for t in glob.glob(f"/proc/{pid}/task/*"):
        try:
            name = open(t + "/comm").read().strip()
            f = open(t + "/stat").read().rsplit(")", 1)[1].split()
            res[name] = res.get(name, 0) + (int(f[11]) + int(f[12])) / TCK
        except OSError:
            pass
    return res
cfg = B.BenchPageConfig(rounds=rounds, out_dir=home)
port = _free_port(); url = f"http://127.0.0.1:{port}/"
proc = start_server(cfg, home, port, *B.NETWORK_LIMITS_OFF)      # as the bench starts it; log: HOME/serve.log
texts = [ex["text"] for ex in load_task("tldr").examples("train")]
from playwright.sync_api import sync_playwright
try:
    client = connect(url, proc)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=B.CHROMIUM, args=B.CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url); page.get_by_role("tab", name="Co-write").click(); page.wait_for_selector("#write-generate")
        prev = None
        for k in range(2 * rounds):
            side = os.environ.get("ONLY") or B.SIDES[k % 2]
            text = texts[(k // 2) % len(texts)]
            pids = tree(proc.pid); ch = chromium_pids()
            c0 = {p: cpu(p) for p in pids}; ch0 = sum(cpu(p) for p in ch); th0 = threads(proc.pid); t0 = time.time()
            r = B.page_round(page, text, prev, 600) if side == "page" else B.api_round(client, text, 600)
            dt = time.time() - t0
            if side == "page": prev = r["group_id"]
            c1 = {p: cpu(p) - c0.get(p, 0) for p in tree(proc.pid)}; ch1 = sum(cpu(p) for p in chromium_pids()) - ch0
            th1 = threads(proc.pid); thd = {n: round(v - th0.get(n, 0), 2) for n, v in th1.items() if v - th0.get(n, 0) > 0.05}
            store = Store(f"sqlite:///{home}/collab.db")
            tok = B.tokens_per_group(store, [r["group_id"]])[r["group_id"]]
            store.close()
            print(json.dumps({"side": side, "tokens": tok, "ms_per_token": round(1000 * r["server_s"] / tok, 1), "wall": round(dt, 2), "round_s": round(r["round_s"], 2), "server_s": r["server_s"],
                              "serve_cpu": round(c1.get(proc.pid, 0), 2),
                              "children_cpu": {p: round(v, 2) for p, v in c1.items() if p != proc.pid and v > 0.05},
                              "chromium_cpu": round(ch1, 2), "serve_threads": thd}), flush=True)
        browser.close()
finally:
    stop_server(proc)

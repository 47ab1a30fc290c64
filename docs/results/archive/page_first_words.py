"""Where a page round's first words spend their time: from the click in Chromium to the words on
the page, split at the server's steps. `collab bench page`'s first words (click -> words, seen
by playwright) are ~0.8 s on the Xeon where the handler's own are ~0.16 s
(docs/results/archive/first_words_window.py); this says where the rest goes.

    python docs/results/archive/page_first_words.py HOME ROUNDS        # from the repository root

ROUNDS rounds a side, in turn: the page (Chromium) and the API (gradio_client /generate, which
never streams to the client: only the server's times `round_start` and `text` are its own).

HOME: a fresh folder (the server's COLLAB_HOME; this machine's calibration is copied in).
The server is `collab serve` as the bench starts it (bench_online.start_server's command), run
by this file's `serve` mode, which wraps a few functions of Gradio's queue and the panel to
log wall-clock times (time.time(), one JSON line each) to HOME/trace.jsonl; the page records
its own (performance.timeOrigin + now(): the same clock, one machine). Per round, every time
is seconds after the click:

  join      the server receives POST .../queue/join (IdentityMiddleware, first in the stack)
  start     Gradio's queue starts the event (Queue.process_events)
  handler   the panel's generator is first resumed (ui._Panel.stream; yields "starting ..." first)
  text      the handler gets the round's first text from the engine (its first progress event
            with words, core.play_round through handlers.generate)
  yielded   the panel yields the update with those words
  sent      Gradio queues that update for the page's stream (Queue.send_message)
  dom       the words are in the page's DOM (a MutationObserver in the page)
  seen      playwright's per-frame poll sees them (what `collab bench page` reports)
After the run each round is marked by whether its engine part until the first text overlapped one
of the trainer child's MAGRPO steps (the store's records), and round_to_text is summarized per side
and mark, with the CPU seconds Chromium's processes and the server's process used in that time
(/proc, sampled every 20 ms).
ENV_SERVE: more environment for the server ("K=V K=V")."""
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")


def serve_traced(trace_path: str, argv: list[str]) -> int:
    """`collab serve` with the timing wrappers (the server process of this script)."""
    from collab_app.web import serve   # first: it sets up the process before torch loads

    import gradio.queueing as Q
    from collab_app.web import handlers as H
    from collab_app.web import identity, ui

    out = open(trace_path, "a", buffering=1)

    def log(what: str, **kw) -> None:
        out.write(json.dumps({"t": time.time(), "what": what, **kw}) + "\n")

    call = identity.IdentityMiddleware.__call__

    async def mw(self, scope, receive, send):
        if scope.get("type") == "http" and scope.get("path", "").endswith("/queue/join"):
            log("join")
        return await call(self, scope, receive, send)
    identity.IdentityMiddleware.__call__ = mw

    process = Q.Queue.process_events

    async def process_events(self, events, *a, **kw):
        log("start", fn=getattr(events[0].fn, "name", None))
        return await process(self, events, *a, **kw)
    Q.Queue.process_events = process_events

    send = Q.Queue.send_message

    def send_message(self, event, message):
        log("sent", msg=str(getattr(message, "msg", "")))
        return send(self, event, message)
    Q.Queue.send_message = send_message

    generate = H.generate

    def traced_generate(*a, **kw):
        log("round")
        first = True
        for ev in generate(*a, **kw):
            if first and ev["kind"] == "progress" and any(p["text"] for c in ev["candidates"] for p in c["parts"]):
                log("text")
                first = False
            yield ev
    H.generate = traced_generate

    stream = ui._Panel.stream

    def traced_stream(self, *a, **kw):
        log("handler")
        for k, upd in enumerate(stream(self, *a, **kw)):
            parts = {p for row in self.parts for p in row}
            vals = [v.get("value") if isinstance(v, dict) else v for comp, v in upd.items() if comp in parts]
            words = any(isinstance(v, str) and "> " in v and "(empty)" not in v for v in vals)
            log("yielded", k=k, words=words)
            yield upd
    ui._Panel.stream = traced_stream
    return serve.cli_main(argv)


# In the page: the click's time (capture phase, before Gradio's own handler) and the first
# mutation that puts words into a candidate part's blockquote, both on the wall clock.
JS_ARM = """() => {
  window.__fw = {click: null, dom: null, cleared: false};
  const btn = document.querySelector('#write-generate');
  btn.addEventListener('click', () => { window.__fw.click = performance.timeOrigin + performance.now(); }, {capture: true, once: true});
  const obs = new MutationObserver(() => {
    if (window.__fw.click === null || window.__fw.dom !== null) return;
    let words = false;
    for (const q of document.querySelectorAll('[id^="write-cand-"][id*="-part-"] blockquote')) {
      const t = q.innerText.trim();
      if (t && t !== '(empty)') { words = true; break; }
    }
    // the previous round's words stay until the round's first update clears the cards
    if (!words) { window.__fw.cleared = true; return; }
    if (window.__fw.cleared) { window.__fw.dom = performance.timeOrigin + performance.now(); obs.disconnect(); }
  });
  obs.observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def main() -> None:
    sys.path.insert(0, ROOT)
    from playwright.sync_api import sync_playwright

    from collab_app.commands import bench_page as B
    from collab_app.commands.bench_online import _free_port, connect, start_server, stop_server
    from tasks import load_task

    home, rounds = os.path.abspath(sys.argv[1]), int(sys.argv[2])
    os.makedirs(home, exist_ok=False)
    trace = os.path.join(home, "trace.jsonl")
    cfg = B.BenchPageConfig(rounds=rounds, out_dir=os.path.join(home, "unused"))   # serve_command reads its fields
    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    # serve through this file's timers (`serve` below), as the bench starts it otherwise
    proc = start_server(cfg, home, port, *B.NETWORK_LIMITS_OFF,
                        launcher=[sys.executable, os.path.abspath(__file__), "serve", trace],
                        env={"PYTHONPATH": ROOT, **dict(kv.split("=", 1) for kv in os.environ.get("ENV_SERVE", "").split())})
    texts = [ex["text"] for ex in load_task("tldr").examples("train")]
    rows = []
    import glob
    import threading
    tck = os.sysconf("SC_CLK_TCK")

    def cpu_of(pids):
        total = 0.0
        for pid in pids:
            try:
                f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                total += (int(f[11]) + int(f[12])) / tck
            except OSError:
                pass
        return total

    def command(path):   # a process may end between the glob and the read
        try:
            with open(path, "rb") as f:
                return f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            return ""

    def chromium_pids():
        return [int(d.split("/")[2]) for d in glob.glob("/proc/[0-9]*/cmdline") if "chromium" in command(d)]
    samples, stop = [], threading.Event()

    def sample():   # (wall clock, Chromium's CPU seconds, the server's) every 20 ms
        while not stop.wait(0.02):
            samples.append((time.time(), cpu_of(chromium_pids()), cpu_of([proc.pid])))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    def cpu_between(a, b):
        inside = [x for x in samples if a <= x[0] <= b]
        if len(inside) < 2:
            return None, None
        return round(inside[-1][1] - inside[0][1], 3), round(inside[-1][2] - inside[0][2], 3)
    try:
        client = connect(url, proc)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=B.CHROMIUM, args=B.CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.get_by_role("tab", name="Co-write").click()
            page.wait_for_selector("#write-generate", timeout=60_000)
            prev = None
            for k in range(2 * rounds):
                side = B.SIDES[k % 2]            # page, api, page, ...: the same text on both sides
                text = texts[(k // 2) % len(texts)]
                if side == "page":
                    page.evaluate(JS_ARM)
                mark = time.time()
                if side == "page":
                    r = B.page_round(page, text, prev, 600)
                    prev = r["group_id"]
                    fw = page.evaluate("() => window.__fw")
                    t0 = fw["click"] / 1000
                else:
                    r = B.api_round(client, text, 600)
                    fw, t0 = None, r["t_start"]
                evs = [json.loads(line) for line in open(trace)]
                evs = [e for e in evs if e["t"] >= mark]

                def first(what, cond=lambda e: True):
                    return next((round(e["t"] - t0, 3) for e in evs if e["what"] == what and cond(e)), None)
                yielded = first("yielded", lambda e: e["words"])
                t_y = t0 + yielded if yielded is not None else None
                row = {"side": side, "round": k // 2, "join": first("join"), "start": first("start"),
                       "handler": first("handler"), "round_start": first("round"), "text": first("text"),
                       "yielded": yielded,
                       "sent": first("sent", lambda e: t_y is not None and e["t"] >= t_y - 1e-6 and "generating" in e["msg"]),
                       "dom": round(fw["dom"] / 1000 - t0, 3) if fw and fw["dom"] else None,
                       "seen": round(r["first_s"] - (t0 - r["t_start"]), 3) if r["first_s"] is not None else None,
                       "click_after_t0": round(t0 - r["t_start"], 3), "round_s": round(r["round_s"], 2),
                       "load": round(os.getloadavg()[0], 2)}
                row["round_to_text"] = (round(row["text"] - row["round_start"], 3)
                                        if row["text"] is not None and row["round_start"] is not None else None)
                if row["round_start"] is not None and row["text"] is not None:
                    row["chromium_cpu"], row["server_cpu"] = cpu_between(t0 + row["round_start"], t0 + row["text"])
                row["t0"] = t0   # wall clock of the click (page) or of the call (API): steps are matched after the run
                rows.append(row)
                print(json.dumps(row), flush=True)
            browser.close()
    finally:
        stop.set()
        stop_server(proc)
    # which rounds' first words were computed while the trainer child was in a MAGRPO step
    from collab_app.online.store import Store
    store = Store(f"sqlite:///{home}/collab.db")
    try:
        steps = B.step_intervals(store.train_steps())
    finally:
        store.close()
    for r in rows:
        if r["round_start"] is not None and r["text"] is not None:
            r["beside_step"] = B.overlap(r["t0"] + r["round_start"], r["t0"] + r["text"], steps) > 0
            print("step", json.dumps({k: r.get(k) for k in ("side", "round", "round_to_text", "beside_step",
                                                            "chromium_cpu", "server_cpu")}))
    keys = ["click_after_t0", "join", "start", "handler", "round_start", "text", "yielded", "sent", "dom", "seen",
            "round_to_text"]
    import statistics
    for side in B.SIDES:
        rs = [r for r in rows if r["side"] == side]
        print("median", side, json.dumps({k: round(statistics.median(r[k] for r in rs if r[k] is not None), 3)
                                          for k in keys if any(r[k] is not None for r in rs)}))
        for beside in (False, True):
            sub = [r["round_to_text"] for r in rs if r.get("beside_step") is beside]
            if sub:
                print("round_to_text", side, "beside a step" if beside else "quiet", len(sub),
                      round(statistics.median(sub), 3))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        sys.path.insert(0, ROOT)
        sys.exit(serve_traced(sys.argv[2], sys.argv[3:]))
    main()

"""`collab bench page`: a person's round, timed in the real page.

Starts a real `collab serve` (a subprocess with its engine, its child trainer on its own cores and
a fresh COLLAB_HOME / store / adapters under --out-dir) and drives it two ways, one round each in
turn, on the same TL;DR texts:
- `page`: headless Chromium (Debian's /usr/bin/chromium through playwright; never a downloaded
  browser) on the Co-write tab, as a person: paste a text, click Generate; timed to the first
  words (`first_s`), to the stored round (`round_s`), and through rating it (`rate_s`);
- `api`: the same rounds through the app's API (gradio_client): the baseline without a browser.
Both sides record the server's own time for the round and the tokens generated; rounds are split
into `quiet` and `beside a step` (of the child trainer), and a probe thread times GET / while the
trainer steps. On a 2-core machine the browser renders beside the server, as on a laptop.

    collab bench page [--rounds 8 --out-dir bench-page --json]

How each figure is counted: docs/BENCHES.md.
"""
from __future__ import annotations

import http.cookiejar
import json
import logging
import os
import re
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass

from collab_app.commands.bench_online import (TEXTS_TASK, free_port, unix_time, api_call, connect, preference,
                                              start_server, stop_server)
from collab_app.web.serve import ServeConfig

log = logging.getLogger(__name__)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
RATER = "short"      # bench_online.preference: what the scripted person likes (fewer words)
SIDES = ("page", "api")

# In the page (Co-write tab; ids from web/ui.py's _Panel "write"): a candidate part's text is a
# blockquote that reads "(empty)" until its agent's first words arrive; the status line ends a
# round with "group #N: ..." (web/core.py). A round's own text counts only once the status no
# longer names the previous round's group (the Generate click clears the cards and the status in
# its first update).
JS_STATE = """([prev, want]) => {
  const status = (document.querySelector('#write-status') || {}).innerText || '';
  const m = status.match(/group #(\\d+):/);
  const rate = document.querySelector('#write-rate-0');
  const done = !!(m && m[1] !== String(prev) && rate && rate.offsetParent !== null);
  let text = false;
  if (done || prev === null || !status.includes('group #' + prev + ':')) {
    for (const q of document.querySelectorAll('[id^="write-cand-"][id*="-part-"] blockquote')) {
      const t = q.innerText.trim();
      if (t && t !== '(empty)') { text = true; break; }
    }
  }
  if (done) return text ? 'done, with words' : 'done, no words';
  return want === 'first' && text ? 'first words' : '';
}"""
JS_CANDIDATES = """() => {
  const out = [];
  for (let i = 0; document.querySelector('#write-cand-' + i); i++) {
    const rate = document.querySelector('#write-rate-' + i);
    if (!rate || rate.offsetParent === null) break;
    out.push(Array.from(document.querySelectorAll('#write-cand-' + i + ' [id*="-part-"] blockquote'))
                 .map(q => q.innerText.trim()).join('\\n'));
  }
  return out;
}"""


@dataclass
class BenchPageConfig:
    rounds: int = 8
    """rounds per side (page and api), taken in turn."""
    engine: str = "auto"
    """serving engine of the `collab serve` it starts (auto | vllm | transformers)."""
    num_generations: int = ServeConfig.num_generations
    """G of the server: candidates per round (serve's default)."""
    max_new_tokens: int = ServeConfig.max_new_tokens
    """new tokens per agent answer (serve's default)."""
    min_groups: int = ServeConfig.min_groups
    """K of the child trainer: a MAGRPO step per K rated groups (serve's default)."""
    think_s: float = 0.0
    """seconds between a round's rating and the next round, as a person reads (0 = back to back)."""
    probe_s: float = 0.5
    """seconds between two fetches of the page (GET /) that time the server's responsiveness (0 = off)."""
    trainer_args: str = ""
    """more `collab trainer` flags for the server's child trainer (one quoted string)."""
    serve_args: str = ""
    """more `collab serve` flags (one quoted string), e.g. "--engine-cores -1"."""
    out_dir: str = "bench-page"
    """where the server's home, its log and bench_page.json go (must not hold a previous run's home)."""
    port: int = 0
    """server port (0 = a free one)."""
    round_timeout_s: float = 600.0
    """a round (generate or rate) that takes longer ends the run (the rounds so far are kept)."""
    chromium: str = CHROMIUM
    """the Chromium executable playwright drives (Debian's `apt-get install chromium`; never a downloaded browser)."""
    json: bool = False
    """print the whole result as JSON instead of the table."""

    def __post_init__(self):
        if self.rounds < 1 or self.num_generations < 2 or self.max_new_tokens < 1 or self.min_groups < 1:
            raise ValueError(f"need rounds >= 1, num_generations >= 2 (MAGRPO compares siblings), max_new_tokens >= 1 "
                             f"and min_groups >= 1; got {self.rounds}, {self.num_generations}, {self.max_new_tokens}, "
                             f"{self.min_groups}")
        if self.think_s < 0 or self.probe_s < 0 or self.round_timeout_s <= 0:
            raise ValueError(f"think_s and probe_s must be >= 0 (0 = none / off) and round_timeout_s > 0; got "
                             f"{self.think_s}, {self.probe_s}, {self.round_timeout_s}")
        if os.path.exists(os.path.join(self.out_dir, "home")):
            raise ValueError(f"{self.out_dir!r} holds a previous run's server home (a run starts from an untrained team "
                             "in a fresh store): pass another --out-dir or remove that folder")
        if not os.path.exists(self.chromium):
            raise ValueError(f"no Chromium at {self.chromium}: `apt-get install chromium` (make browser-deps) or pass "
                             "--chromium PATH")


NETWORK_LIMITS_OFF = ("--max-rounds-per-minute-per-network", "0", "--max-ratings-per-minute-per-network", "0",
                      "--max-rounds-in-flight-per-network", "0")
"""serve flags beside bench_online.serve_command's: the bench's page and API client are one network."""


def server_seconds(message: str) -> float | None:
    """The server's own time of a round from its message ("group #N: G candidates in X s ...")."""
    m = re.search(r"candidates in ([0-9.]+) s", message or "")
    return float(m.group(1)) if m else None


class Prober(threading.Thread):
    """Fetches `url` every `every_s` seconds until stopped: (unix time, seconds) per fetch; a
    failed fetch counts as None (the server did not answer within 60 s). One session: it keeps
    the server's session cookie (a fetch without one would be a new visitor, and the server
    admits only so many new sessions a minute per network)."""

    def __init__(self, url: str, every_s: float):
        super().__init__(daemon=True)
        self.url, self.every_s, self.stop, self.samples = url, every_s, threading.Event(), []
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))

    def run(self):
        while not self.stop.wait(self.every_s):
            t0, took = time.time(), None
            try:
                with self.opener.open(self.url, timeout=60) as r:
                    r.read()
                took = time.time() - t0
            except OSError:
                pass
            self.samples.append((t0, took))


def page_round(page, text: str, prev: int | None, timeout_s: float) -> dict:
    """One round in the page: paste, Generate, first words, the stored round; then rate and submit."""
    rate = preference(RATER)
    page.locator("#write-text textarea").fill(text)
    ms = int(timeout_s * 1000)
    t_wall, t0 = time.time(), time.perf_counter()
    page.click("#write-generate")
    # Polled at every frame in the page; a round seen first when done has its first words then
    # (none at all: a round whose answers are all empty)
    state = page.wait_for_function(JS_STATE, arg=[prev, "first"], polling="raf", timeout=ms).json_value()
    first = time.perf_counter() - t0
    if state == "first words":
        state = page.wait_for_function(JS_STATE, arg=[prev, "done"], polling="raf", timeout=ms).json_value()
    done = time.perf_counter() - t0
    if state == "done, no words":
        first = None
    t_end = time.time()
    status = page.inner_text("#write-status")
    group_id = int(re.search(r"group #(\d+):", status).group(1))
    texts = page.evaluate(JS_CANDIDATES)
    ratings = [rate(t) for t in texts]
    t1 = time.perf_counter()
    for i, r in enumerate(ratings):
        page.click(f"#write-rate-{i} label:has-text('{r}')")
    page.click("#write-submit")
    page.wait_for_selector("#write-rate-msg:has-text('rating saved')", timeout=ms)
    return {"side": "page", "group_id": group_id, "t_start": t_wall, "t_end": t_end, "first_s": first,
            "round_s": done, "rate_s": time.perf_counter() - t1, "server_s": server_seconds(status),
            "ratings": ratings}


def api_round(client, text: str, timeout_s: float) -> dict:
    """The same round through the API: /generate, then /rate per candidate."""
    rate = preference(RATER)
    t_wall, t0 = time.time(), time.perf_counter()
    out = api_call(client, timeout_s=timeout_s, task=TEXTS_TASK, text=text, api_name="/generate")
    done = time.perf_counter() - t0
    t_end = time.time()
    ratings = [rate(c["combined"]) for c in out["candidates"]]
    t1 = time.perf_counter()
    for c, r in zip(out["candidates"], ratings):
        api_call(client, timeout_s=timeout_s, joint_sample_id=c["joint_sample_id"], rating=r, api_name="/rate")
    return {"side": "api", "group_id": out["group_id"], "t_start": t_wall, "t_end": t_end, "first_s": None,
            "round_s": done, "rate_s": time.perf_counter() - t1, "server_s": server_seconds(out["message"]),
            "ratings": ratings}


def step_intervals(steps: list[dict]) -> list[tuple[float, float]]:
    """[start, end] in unix time of each recorded MAGRPO step (end = its record, start = end - update_s)."""
    out = []
    for s in steps:
        end = unix_time(s["created_at"])
        out.append((end - float(s["metrics"].get("time/update_s") or 0.0), end))
    return out


def overlap(t0: float, t1: float, intervals: list[tuple[float, float]]) -> float:
    """Seconds of [t0, t1] inside any of `intervals` (which do not overlap one another: one trainer)."""
    return sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in intervals)


def classify(rounds: list[dict], probes: list[tuple[float, float | None]], intervals) -> list[dict]:
    """Marks each round `beside a step` (it overlaps a step) or `quiet`, with the overlap's share;
    returns the probes as records with the same mark."""
    for r in rounds:
        o = overlap(r["t_start"], r["t_end"], intervals)
        r["kind"] = "beside a step" if o > 0 else "quiet"
        r["step_share"] = o / max(1e-9, r["t_end"] - r["t_start"])
    return [{"t": t, "s": s, "kind": "during a step" if overlap(t, t + (s or 0.0) + 1e-6, intervals) > 0 else "outside a step"}
            for t, s in probes]


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(rounds: list[dict], probes: list[dict]) -> dict:
    """Per side and kind of round: n and medians (first words, round, server's part, rating,
    tokens/s); the probes' median and worst per kind, and the fetches that got no answer."""
    out: dict = {}
    for side in SIDES:
        for kind in ("quiet", "beside a step"):
            rs = [r for r in rounds if r["side"] == side and r["kind"] == kind]
            if rs:
                out.setdefault(side, {})[kind] = {
                    "n": len(rs), "first_s": _median(r["first_s"] for r in rs), "round_s": _median(r["round_s"] for r in rs),
                    "server_s": _median(r["server_s"] for r in rs), "rate_s": _median(r["rate_s"] for r in rs),
                    "tokens": _median(r.get("tokens") for r in rs),
                    "tokens_per_s": _median(r["tokens"] / r["round_s"] for r in rs if r.get("tokens")),
                    "step_share": _median(r["step_share"] for r in rs)}
    for kind in ("outside a step", "during a step"):
        ps = [p for p in probes if p["kind"] == kind]
        ok = [p["s"] for p in ps if p["s"] is not None]
        if ps:
            out.setdefault("probe", {})[kind] = {"n": len(ps), "median_s": _median(ok), "max_s": max(ok, default=None),
                                                "unanswered": len(ps) - len(ok)}
    return out


def tokens_per_group(store, group_ids: list[int]) -> dict[int, int]:
    """Tokens the team generated per group (all agents' samples; the store's token ids)."""
    return {g: sum(len(s.token_ids) for row in store.group(g).samples for s in row) for g in group_ids}


def run(cfg: BenchPageConfig) -> dict:
    from playwright.sync_api import sync_playwright
    from tasks import load_task

    out_dir = os.path.abspath(cfg.out_dir)
    home = os.path.join(out_dir, "home")
    os.makedirs(home, exist_ok=False)   # a fresh store and adapters: version 0, the untrained team
    port = cfg.port or free_port()
    url = f"http://127.0.0.1:{port}/"
    t_up = time.time()
    proc = start_server(cfg, home, port, *NETWORK_LIMITS_OFF)
    texts = [ex["text"] for ex in load_task(TEXTS_TASK).examples("train")]
    rounds: list[dict] = []
    error, prober, startup_s = None, None, None
    loadavg_start = os.getloadavg()
    try:
        client = connect(url, proc)
        startup_s = time.time() - t_up
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=cfg.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.get_by_role("tab", name="Co-write").click()
            page.wait_for_selector("#write-generate", timeout=60_000)
            if cfg.probe_s:
                prober = Prober(url, cfg.probe_s)
                prober.start()
            prev = None
            try:
                for k in range(2 * cfg.rounds):
                    text = texts[(k // 2) % len(texts)]     # both sides get the same texts
                    side = SIDES[k % 2]
                    r = page_round(page, text, prev, cfg.round_timeout_s) if side == "page" else \
                        api_round(client, text, cfg.round_timeout_s)
                    if side == "page":
                        prev = r["group_id"]
                    r["round"] = k
                    rounds.append(r)
                    log.info("round %d/%d (%s): first words %s, round %.2f s (server %s s), rated in %.2f s",
                             k + 1, 2 * cfg.rounds, side, "-" if r["first_s"] is None else f"{r['first_s']:.2f} s",
                             r["round_s"], r["server_s"], r["rate_s"])
                    if cfg.think_s:
                        time.sleep(cfg.think_s)
            except Exception as e:  # noqa: BLE001 - a hung or dead server is a result too: keep what came before
                error = f"{type(e).__name__}: {e} after {len(rounds)} rounds"
                log.error("rounds stopped: %s", error)
            finally:
                browser.close()
    finally:
        if prober:
            prober.stop.set()
            prober.join(70)
        stop_server(proc)
    db_url = f"sqlite:///{home}/collab.db"
    from collab_app.online.store import Store

    store = Store(db_url)
    try:
        steps = store.train_steps()
        tokens = tokens_per_group(store, [r["group_id"] for r in rounds])
    finally:
        store.close()
    for r in rounds:
        r["tokens"] = tokens.get(r["group_id"])
    probes = classify(rounds, prober.samples if prober else [], step_intervals(steps))
    from trainer.dtypes import cpu_capability

    result = {"config": asdict(cfg), "startup_s": startup_s, "error": error,
              "machine": {"cpus": os.cpu_count(), "cpu_capability": cpu_capability(),
                          "load_avg_start": [round(x, 2) for x in loadavg_start],
                          "load_avg_end": [round(x, 2) for x in os.getloadavg()]},
              "steps": [{"step": s["step"], "t_end": unix_time(s["created_at"]), "update_s": s["metrics"].get("time/update_s"),
                         "groups": len(s["group_ids"])} for s in steps],
              "rounds": rounds, "probes": probes, "summary": summarize(rounds, probes)}
    with open(os.path.join(out_dir, "bench_page.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def table(result: dict) -> str:
    """The summary side by side: page (Chromium) next to api (gradio_client), per kind of round."""
    s, cfg, m = result["summary"], result["config"], result["machine"]

    def cell(side, kind, key, unit=" s", fmt="{:.2f}"):
        v = s.get(side, {}).get(kind, {}).get(key)
        return "-" if v is None else fmt.format(v) + unit

    lines = [f"collab bench page: {cfg['rounds']} rounds a side, G={cfg['num_generations']} x 2 agents x "
             f"<= {cfg['max_new_tokens']} tokens, engine {cfg['engine']}, {len(result['steps'])} MAGRPO steps; CPU "
             f"{m['cpu_capability']} x {m['cpus']}; load avg {m['load_avg_start'][0]} -> {m['load_avg_end'][0]}; "
             f"server up in {result['startup_s'] or 0:.1f} s",
             f"{'':32s} {'page (Chromium)':>18s} {'api (gradio_client)':>20s}"]
    for kind in ("quiet", "beside a step"):
        lines.append(f"{'rounds ' + kind:32s} {cell('page', kind, 'n', '', '{}'):>18s} {cell('api', kind, 'n', '', '{}'):>20s}")
        for key, label in (("first_s", "first words"), ("round_s", "round, until rating opens"),
                           ("server_s", "of it the server's own"), ("rate_s", "rating saved"),
                           ("tokens_per_s", "tokens/s (round)")):
            unit, fmt = ("", "{:.0f}") if key == "tokens_per_s" else (" s", "{:.2f}")
            lines.append(f"  {label:30s} {cell('page', kind, key, unit, fmt):>18s} {cell('api', kind, key, unit, fmt):>20s}")
    for kind, p in s.get("probe", {}).items():
        med = "-" if p["median_s"] is None else f"{1000 * p['median_s']:.0f} ms"
        worst = "-" if p["max_s"] is None else f"{1000 * p['max_s']:.0f} ms"
        lines.append(f"page fetch (GET /) {kind}: median {med}, worst {worst}, n={p['n']}, unanswered {p['unanswered']}")
    if result["error"]:
        lines.append(f"stopped early: {result['error']}")
    return "\n".join(lines)


def cli_main(argv: list[str] | None = None) -> int:
    from trainer.configcli import parse_config

    cfg, _ = parse_config(BenchPageConfig, argv, prog="collab bench page",
                          description="A person's round timed in the real page (headless Chromium) next to the same "
                                      "rounds through the API, on a `collab serve` it starts; quiet and beside a "
                                      "MAGRPO step.")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench-page %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per gradio_client request otherwise
    res = run(cfg)
    print(json.dumps(res, indent=1) if cfg.json else table(res))
    print(f"wrote {os.path.join(os.path.abspath(cfg.out_dir), 'bench_page.json')}", file=sys.stderr)
    return 1 if res["error"] else 0


if __name__ == "__main__":
    sys.exit(cli_main())

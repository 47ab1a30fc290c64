"""`collab serve`: engine + Gradio app + trainer service + adapter hot-swap, in one command.

    collab serve [--host 127.0.0.1 --port 7860 --engine auto --vllm-compile auto --model ...
                  --trainer child|external|off --db URL --share --engine-cores 0]

What runs where:
- this process: the engine (vLLM or transformers), the store, the Gradio app (collab_app/web/ui.py)
  and the hot-swap watcher (collab_app/online/hotswap.py) that loads each new adapter version the
  trainer publishes, between requests;
- `--trainer child` (default): `collab trainer` as a child process on the same store and
  adapters dir (`ChildTrainer`), restarted whenever it dies with a back-off that grows with
  crashes in a row, never given up for good; the Training tab says why it is not training. It is
  stopped with SIGTERM when this process exits, and stops by itself if this process is killed
  (`--parent-pid`). `external`: run `collab trainer --db URL` yourself; `off`: collect data only.
  The child samples nothing unless `--self-play` (then with a transformers engine).
- on CPU, with a child trainer, the cores are split between this process and the child
  (`--engine-cores`, collab_app/cpu/cores.py; docs/CPU.md).

In public: a strong COLLAB_ADMIN_TOKEN or no admin (`--loopback-admin`: never behind a proxy on
the same machine), umask 077, a weak or unconfined sandbox on a public host stops the start
unless the operator accepts it, and the secrets are read once and dropped from the environment
before the model, the engine or the trainer child start (collab_app/secret_env.py);
docs/ARCHITECTURE.md "`collab serve` in public" has each rule.

vLLM starts its engine core with multiprocessing `spawn`, which re-imports the main module: the
console script `collab` and `python -m collab_app.web.serve` both call `cli_main` only under
`if __name__ == "__main__"`, so that re-import starts nothing. A script of your own that calls
`serve(cfg)` needs the same guard (app.py has it).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from collab_app import paths
from collab_app.cpu import process
from collab_app.cpu.cores import cpu_budget
from tasks import SERVED_BY_DEFAULT, sandbox

ANONYMOUS_SHARE = 0.25
"""the trainer child's max_anonymous_share where Hugging Face sign-in is available (`--anonymous-share`)."""

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    """address to listen on (0.0.0.0 makes the app public: admin actions then need COLLAB_ADMIN_TOKEN)."""
    port: int = 7860
    """port of the web app."""
    share: bool = False
    """also open a public Gradio share link."""
    engine: Literal["auto", "vllm", "transformers"] = "auto"
    """serving engine: auto (see collab_app/engines/__init__.py), vllm or transformers."""
    engine_url: str = ""
    """generate on a running vLLM OpenAI-compatible server instead, e.g. http://127.0.0.1:8000 (overrides --engine; it must read the adapters dir at the same path: collab_app/engines/engine_remote.py)."""
    engine_retry_s: float = 15.0
    """with --engine-url: seconds a lost server is retried (with back-off) before a round or an adapter load fails (0 = at once)."""
    vllm_compile: Literal["auto", "on", "off"] = "auto"
    """vLLM in this process: auto = as the engine race measured on this CPU (docs/ENGINES.md); on = compiled by torch.compile (CPU: bf16 only; the first start on a machine compiles for ~1-2 minutes, later ones load it and start ~3 s slower than eager); off = eager."""
    model: str = ""
    """base model: HF id or local folder (empty = $COLLAB_MODEL, else the embedded SmolLM2-135M-Instruct)."""
    agent_models: list[str] = field(default_factory=list)
    """a heterogeneous team: ROLE=MODEL entries put that role's agent on its own base (HF id or folder) in every task that has the role, served and trained there; other roles stay on --model."""
    db: str = ""
    """store URL (empty = $COLLAB_DB, else sqlite:///$COLLAB_HOME/collab.db); the trainer gets the same."""
    adapters_dir: str = ""
    """adapter versions written by the trainer (empty = $COLLAB_HOME/adapters); with --trainer external on another machine: this host's mount of the shared adapters dir."""
    trainer: Literal["child", "external", "off"] = "child"
    """child: start `collab trainer` here; external: one runs elsewhere on the same store; off: no training."""
    self_play: bool = False
    """the child trainer also samples the train split between human groups (demo: learns without visitors)."""
    min_groups: int = 4
    """K for the child trainer: a step as soon as this many groups of a task are ready."""
    trainer_args: str = ""
    """more `collab trainer` flags for the child, one quoted string: --trainer-args "--learning-rate 5e-5 --return-mode auto"."""
    tasks: list[str] = field(default_factory=lambda: list(SERVED_BY_DEFAULT))
    """tasks offered in the app."""
    num_generations: int = 2
    """G: joint answers per prompt (>= 2)."""
    max_new_tokens: int = 256
    """new tokens per agent answer."""
    temperature: float = 0.8
    """sampling temperature of the team's answers (> 0: siblings must differ)."""
    max_rounds_per_minute: int = 10
    """rounds one session (or login) may start per minute (0 = no limit; scripted raters in benches)."""
    max_ratings_per_minute: int = 60
    """ratings one session may submit per minute (a ranking of G counts G; 0 = no limit)."""
    max_rounds_in_flight: int = 1
    """rounds one session (or login) may have generating at once (0 = no limit)."""
    max_rounds_in_flight_per_network: int = 4
    """most rounds one client network may have generating at once over all its sessions, fewer while others generate (a fair share of the 8 slots; 0 = no limit)."""
    max_new_sessions_per_minute: int = 20
    """sessions one client network may start per minute (a classroom behind one NAT may need more; 0 = no limit)."""
    max_rounds_per_minute_per_network: int = 30
    """rounds one client network may start per minute over all its sessions (0 = no limit)."""
    max_ratings_per_minute_per_network: int = 240
    """ratings one client network may store per minute over all its sessions (0 = no limit)."""
    max_ratings_per_minute_global: int = 600
    """ratings all visitors and API keys together may store per minute (0 = no limit): a crowd of fresh identities cannot outvote the rest."""
    require_login_to_rate: bool = False
    """ratings from the page need a Hugging Face login (a Space with `hf_oauth: true` in its README); API keys still rate."""
    anonymous_share: float = ANONYMOUS_SHARE
    """where Hugging Face sign-in is available (a Space with `hf_oauth: true`): most of a trainer step's groups that ratings of visitors who did not sign in may decide, all together (1 = no cap)."""
    loopback_admin: bool = False
    """clients on this machine are admin without a token (refused on a public app: behind a proxy everyone looks local)."""
    api_keys_file: str = ""
    """keys for the OpenAI-compatible /v1 API, one per line (also $COLLAB_API_KEYS, comma-separated); no keys = /v1 off."""
    api_max_rounds_per_minute: int = 10
    """chat completions one API key may start per minute (0 = no limit)."""
    api_max_ratings_per_minute: int = 60
    """ratings one API key may store per minute (0 = no limit)."""
    page_update_s: float = 0.25
    """least seconds between two updates of a round streaming into the page (each costs the engine's process ~20-30 ms of Python)."""
    swap_interval_s: float = 2.0
    """how often the hot-swap watcher looks for new adapter versions."""
    engine_cores: int = 0
    """CPU cores for serving; the trainer child gets the others (0 = auto: half; -1 = share all, as before; no effect on GPU)."""
    borrow_cores: bool = True
    """with the split, the engine also decodes on the trainer child's cores while the trainer is not in a step (lending.CoreLease)."""
    lend_engine_cores: bool = True
    """with borrow_cores, a training step also works on the engine's cores while no round is being generated, and gives them back when one starts (lending.CoreLease)."""

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1..65535, got {self.port}")
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2: MAGRPO compares siblings")
        limits = ("max_rounds_per_minute", "max_ratings_per_minute", "max_rounds_in_flight",
                  "max_rounds_in_flight_per_network", "max_new_sessions_per_minute",
                  "max_rounds_per_minute_per_network", "max_ratings_per_minute_per_network",
                  "max_ratings_per_minute_global")
        for name in limits:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}")
        if not 0.0 < self.anonymous_share <= 1.0:
            raise ValueError(f"anonymous_share must be in (0, 1] (1 = no cap), got {self.anonymous_share}")
        if self.swap_interval_s <= 0 or self.min_groups < 1:
            raise ValueError("swap_interval_s must be > 0 and min_groups >= 1")
        if not self.page_update_s > 0:
            raise ValueError(f"page_update_s must be > 0 seconds (0.25: four updates a second), got {self.page_update_s}")
        if self.engine_url and not self.engine_url.startswith(("http://", "https://")):
            raise ValueError(f"engine_url must start with http:// or https://, e.g. http://127.0.0.1:8000; got {self.engine_url!r}")
        if self.engine_retry_s < 0:
            raise ValueError(f"engine_retry_s must be >= 0 (0 = no retry), got {self.engine_retry_s}")
        if self.api_max_rounds_per_minute < 0 or self.api_max_ratings_per_minute < 0:
            raise ValueError("api_max_rounds_per_minute and api_max_ratings_per_minute must be >= 0 (0 = no limit)")
        bad = [m for m in self.agent_models if not (m.partition("=")[0].strip() and m.partition("=")[2].strip())]
        if bad:
            raise ValueError(f"agent_models {bad}: give ROLE=MODEL entries (the app serves several tasks, so name "
                             f"the role), e.g. --agent-models main=/path/to/model")
        if self.agent_models and self.engine_url:
            raise ValueError("--agent-models with --engine-url: a vLLM server serves one base model; serve a "
                             "heterogeneous team with the in-process engines (--engine auto|vllm|transformers)")
        if self.vllm_compile != "auto" and (self.engine_url or self.engine == "transformers"):
            raise ValueError(f"--vllm-compile {self.vllm_compile} applies to vLLM in this process; with "
                             f"{'--engine-url' if self.engine_url else '--engine transformers'} leave it at auto")
        if self.engine_cores < -1:
            raise ValueError(f"engine_cores must be -1 (no split), 0 (auto) or a core count, got {self.engine_cores}")


ALLOW_WEAK_PUBLIC_ENV = "COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC"
""""1" together with COLLAB_SANDBOX_ALLOW_WEAK=1: the operator accepts weak isolation on a public app."""


def check_weak_sandbox(cfg: ServeConfig) -> None:
    """ValueError when COLLAB_SANDBOX_ALLOW_WEAK=1 (as tasks/sandbox.py reads it: only "1" counts)
    meets a public app, unless COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC=1 says the operator accepts it
    (then a warning). Called before anything is created (module doc)."""
    from collab_app.web.context import is_public
    from tasks.sandbox import ALLOW_WEAK_ENV

    if os.environ.get(ALLOW_WEAK_ENV, "") != "1" or not is_public(cfg.host, cfg.share):
        return
    where = ("SPACE_ID is set (a Hugging Face Space)" if os.environ.get("SPACE_ID")
             else "--share opens a public link" if cfg.share else f"--host {cfg.host} is reachable from other machines")
    risk = (f"{ALLOW_WEAK_ENV}=1 on a public app ({where}): where the sandbox is weak (\"plain\" mode, e.g. a "
            "Space), code and tests typed by visitors run with this server's user and can read the store, "
            "the adapters and the files it serves, and kill it (tasks/sandbox.py)")
    if os.environ.get(ALLOW_WEAK_PUBLIC_ENV, "") == "1":
        log.warning("%s; %s=1 says that is accepted", risk, ALLOW_WEAK_PUBLIC_ENV)
        return
    raise ValueError(f"{risk}. Unset {ALLOW_WEAK_ENV} (people's own coding problems are then offered only "
                     f"where the sandbox is strong), serve on 127.0.0.1, or also set {ALLOW_WEAK_PUBLIC_ENV}=1 "
                     "to accept that risk")


def check_unconfined_sandbox(cfg: ServeConfig) -> None:
    """ValueError (tasks.sandbox.UnconfinedSandboxError) on a public app where model-written code would
    run unconfined ("plain" without Landlock), unless COLLAB_SANDBOX_ALLOW_UNCONFINED=1 accepts it
    (then a warning). Probes the sandbox now (cached for the engine's checks). Module doc."""
    from collab_app.web.context import is_public
    from tasks.sandbox import check_public_host

    if is_public(cfg.host, cfg.share):
        check_public_host("SPACE_ID is set (a Hugging Face Space)" if os.environ.get("SPACE_ID")
                          else "--share opens a public link" if cfg.share else f"--host {cfg.host}")


def check_loopback_admin(cfg: ServeConfig) -> None:
    """ValueError when --loopback-admin meets a public app: a Space, a share link or a reverse proxy
    on this machine makes visitors' requests arrive from 127.0.0.1, and every one of them would be admin."""
    from collab_app.web.context import is_public

    if cfg.loopback_admin and is_public(cfg.host, cfg.share):
        raise ValueError("--loopback-admin on a public app (a Space, --share, or a host other than 127.0.0.1): "
                         "a proxy or share link makes visitors arrive from this machine, and each would be admin. "
                         "Drop the flag and set a strong COLLAB_ADMIN_TOKEN instead")


def check_login(cfg: ServeConfig, environ=None) -> None:
    """ValueError when ratings need a Hugging Face login that nobody can give here (no OAuth)."""
    from collab_app.web.access import hf_login_available

    if cfg.require_login_to_rate and not hf_login_available(environ):
        raise ValueError("--require-login-to-rate needs Hugging Face sign-in, which only a Space with `hf_oauth: "
                         "true` in its README front matter offers (SPACE_ID and OAUTH_CLIENT_ID are set there); "
                         "without it nobody could rate. Add hf_oauth to the Space, or drop the flag")


class ChildTrainer:
    """`collab trainer` as a child process, restarted whenever it dies, stopped on exit.

    Restarts never end for good: after the k-th exit in a row the next start waits
    base_delay_s * 2^(k-1), at most `max_delay_s` (10 min), and a run that lasted `healthy_s`
    starts the count afresh. A crash loop from a fault that is later mended (a full disk, a store
    that was down, a file fixed by hand) then resumes training by itself, and a crash after days
    of healthy running waits seconds, not the back-off of a loop long gone; a loop that lasts
    costs one start per 10 minutes. The child's stderr passes through to this process's and its
    last lines are kept, so `describe()` tells the Training tab why nothing trains ("trainer
    crashed 6 times in a row (exit code 1), restarting in 64 s; last error: ...") where its
    missing heartbeat alone says only "not running"."""

    TAIL_LINES = 40

    def __init__(self, argv: list[str], cores: tuple[int, ...] | None = None,
                 env: dict[str, str] | None = None, load_on: tuple[int, ...] | None = None,
                 base_delay_s: float = 2.0, max_delay_s: float = 600.0, healthy_s: float = 300.0,
                 clock=None):
        """`cores`: run it on these cores only (collab_app/cpu/); None = any.
        `load_on`: with `cores`, start it on these (a superset) until it has loaded torch, so its
        OpenMP runs at full speed when it widens onto them (pin.pinned_command).
        `env`: added to this process's environment as it is at each start (trainer_env: the store
        URL goes there, never into `argv`, which every user of the machine can read).
        `base_delay_s`, `max_delay_s`, `healthy_s`: the restart back-off (class doc); `clock`:
        seconds, time.monotonic by default."""
        if not 0 < base_delay_s <= max_delay_s or healthy_s <= 0:
            raise ValueError(f"need 0 < base_delay_s <= max_delay_s and healthy_s > 0, got {base_delay_s}, "
                             f"{max_delay_s}, {healthy_s}")
        self.env = dict(env or {})
        self.cmd = [sys.executable, "-m", "collab_app.cli", "trainer", *argv, "--parent-pid", str(os.getpid())]
        if cores:
            from collab_app.cpu.pin import pinned_command

            self.cmd = pinned_command(cores, self.cmd, load_on)
        self.base_delay_s, self.max_delay_s, self.healthy_s = base_delay_s, max_delay_s, healthy_s
        self.clock = clock or time.monotonic
        self.proc: subprocess.Popen | None = None
        self.restarts = 0              # starts after the first, in this app's life
        self.crashes = 0               # exits in a row without a healthy run between them
        self.last_exit: int | None = None
        self.last_error: str | None = None   # the telling line of the last run's stderr
        self.started_at: float | None = None
        self.next_start_at: float | None = None   # `clock` time of the restart waited for; None = not waiting
        self._tail: collections.deque = collections.deque(maxlen=self.TAIL_LINES)
        self._pump: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watch = threading.Thread(target=self._supervise, name="collab-trainer-child", daemon=True)

    def start(self) -> "ChildTrainer":
        log.info("starting trainer service: %s", " ".join(self.cmd))
        self._spawn()
        self._watch.start()
        return self

    def _spawn(self) -> None:
        """Start a run (unless stopping); a start that fails counts as a crash of that run."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._tail, self._pump = collections.deque(maxlen=self.TAIL_LINES), None
            self.started_at, self.next_start_at = self.clock(), None
            try:
                self.proc = self._popen()
            except OSError as e:
                self.proc = None
                self._tail.append(f"could not start `{' '.join(self.cmd[:4])} ...`: {e}")
                log.error("trainer service could not start: %s", e)
                return
            stream = getattr(self.proc, "stderr", None)
            if stream is not None:
                self._pump = threading.Thread(target=self._pass_through, args=(stream, self._tail),
                                              name="collab-trainer-stderr", daemon=True)
                self._pump.start()

    @staticmethod
    def _pass_through(stream, tail: collections.deque) -> None:
        """Copy the child's stderr to ours line by line, keeping the last lines in `tail`."""
        out = getattr(sys.stderr, "buffer", None)
        for line in iter(stream.readline, b""):
            tail.append(line.decode("utf-8", "replace").rstrip())
            try:
                if out is not None:
                    out.write(line)
                    out.flush()
                else:
                    sys.stderr.write(line.decode("utf-8", "replace"))
            except (OSError, ValueError):
                pass   # our stderr is gone: keep reading, or the child would block on a full pipe
        stream.close()

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            proc = self.proc
            rc = proc.wait() if proc is not None else None
            if self._stopping.is_set():
                return
            if self._pump is not None:
                self._pump.join(2.0)   # its last lines, unless a grandchild holds the pipe open
            with self._lock:
                ran = self._ran()
                if ran >= self.healthy_s:
                    self.crashes = 0
                self.crashes += 1
                self.last_exit, self.last_error = rc, telling_line(self._tail)
                delay = min(self.base_delay_s * 2 ** (self.crashes - 1), self.max_delay_s)
                self.next_start_at = self.clock() + delay
            log.warning("trainer service exited (%s) after %.0f s, %d time%s in a row; restart in %.0f s (it resumes "
                        "from the store and the latest complete adapters)%s", exit_text(rc), ran, self.crashes,
                        "" if self.crashes == 1 else "s", delay,
                        f"; last error: {self.last_error}" if self.last_error else "")
            if self._stopping.wait(delay):
                return
            self.restarts += 1
            self._spawn()

    def _ran(self) -> float:
        """Seconds since the current (or last) run started."""
        return 0.0 if self.started_at is None else self.clock() - self.started_at

    def describe(self) -> str:
        """Why the trainer is not training, for the page: "" while it runs healthily (or was stopped)."""
        with self._lock:
            if self._stopping.is_set() or not self.crashes:
                return ""
            times = f"{self.crashes} time{'' if self.crashes == 1 else 's'} in a row"
            error = f"; last error: {self.last_error}" if self.last_error else ""
            if self.next_start_at is not None:
                wait = max(0.0, self.next_start_at - self.clock())
                return f"trainer crashed {times} ({exit_text(self.last_exit)}), restarting in {wait:.0f} s{error}"
            ran = self._ran()
            if ran >= self.healthy_s:
                return ""
            return (f"trainer restarted {ran:.0f} s ago after it crashed {times} ({exit_text(self.last_exit)}"
                    f"{error})")

    def running(self) -> bool:
        """Whether a run is under way now (started and not exited)."""
        proc = self.proc
        return proc is not None and proc.poll() is None and self.next_start_at is None

    def _popen(self) -> subprocess.Popen:
        return subprocess.Popen(self.cmd, env={**os.environ, **self.env}, stderr=subprocess.PIPE)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (the service abandons a step under way at its next layer, nothing of it saved;
        under torchrun it finishes the step), then SIGKILL after `timeout`."""
        with self._lock:
            self._stopping.set()
            proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("trainer service did not stop in %.0fs: killing it", timeout)
            proc.kill()
            proc.wait()


_ERROR_LINE = re.compile(r"^([\w.]+(Error|Exception|Exit|Interrupt)\b|.*\b(ERROR|CRITICAL|Traceback)\b)")


def telling_line(lines, limit: int = 300) -> str | None:
    """The line of a run's last stderr lines that says why it ended: the last exception line
    ("RuntimeError: ...", a traceback's end) or ERROR log line, else the last line; None for none."""
    lines = [x.strip() for x in lines if x and x.strip()]
    if not lines:
        return None
    hits = [x for x in lines if _ERROR_LINE.match(x) and not x.startswith("Traceback")]
    line = (hits or lines)[-1]
    return line if len(line) <= limit else line[:limit - 1] + "…"


def exit_text(rc: int | None) -> str:
    """"exit code 1", "killed by SIGKILL", or "did not start" (rc None)."""
    if rc is None:
        return "did not start"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def trainer_argv(cfg: ServeConfig, adapters_dir: str, model_path: str,
                 agent_models: dict[str, str] | None = None) -> list[str]:
    """The child trainer's flags. `db` is not among them: a command line is readable by every user
    of the machine (/proc/<pid>/cmdline), and a store URL may hold a password; it goes in the
    child's environment (`trainer_env(db)`), which the trainer reads once and drops."""
    from collab_app.online.service import PUBLIC_RATER_SHARE
    from collab_app.web.access import hf_login_available
    from collab_app.web.context import is_public
    from collab_app.web.identity import trusted_proxy_hops

    argv = ["--adapters-dir", adapters_dir, "--model", model_path,
            "--min-groups", str(cfg.min_groups), "--engine", "transformers",
            "--num-generations", str(cfg.num_generations),
            "--self-play" if cfg.self_play else "--no-self-play"]
    # a public app (or one behind a trusted proxy, which forwards other people's requests): no
    # single rater, and no client network, decides more than a share of a step; a local app has
    # one person rating everything, whose groups would otherwise train one per step
    if is_public(cfg.host, cfg.share) or trusted_proxy_hops() > 0:
        argv += ["--max-rater-share", str(PUBLIC_RATER_SHARE), "--max-network-share", str(PUBLIC_RATER_SHARE)]
    if hf_login_available():   # where people can sign in, anonymous raters together get one share
        argv += ["--max-anonymous-share", str(cfg.anonymous_share)]
    if agent_models:   # role -> its base's folder: the child trains each agent on the base it is served on
        argv += ["--agent-models", *(f"{role}={path}" for role, path in agent_models.items())]
    return argv + shlex.split(cfg.trainer_args)   # later flags win (argparse)


def check_agent_roles(agent_models: dict, task_names) -> None:
    """ValueError naming the served roles when --agent-models names a role no served task has."""
    from tasks import load_task

    roles = {r for name in task_names for r in load_task(name).roles}
    unknown = sorted(set(agent_models) - roles)
    if unknown:
        raise ValueError(f"--agent-models names {unknown}, which no served task has (--tasks {list(task_names)}: "
                         f"roles {sorted(roles)}); name one of those roles")


def trainer_env(db: str) -> dict[str, str]:
    """The child trainer's store URL, as its environment (COLLAB_DB), not its command line."""
    return {"COLLAB_DB": db}


def remote_engine_url(cfg: ServeConfig) -> str:
    """The vLLM server that generates, or "": --engine-url, or COLLAB_ENGINE=URL with --engine auto
    (as make_engine reads it)."""
    target = cfg.engine_url or (os.environ.get("COLLAB_ENGINE", "") if cfg.engine == "auto" else "")
    return target if target.startswith(("http://", "https://")) else ""


RACE_AFTER_S = 30.0
"""a background engine race starts this long after the page is up (a first visitor's first rounds)."""


class BackgroundRace:
    """Engine `auto` on a CPU where nobody has raced the engines for a base yet (choose.race_missing):
    the race runs in a process of its own, niced, RACE_AFTER_S after the page is up, and caches its
    verdict per machine; this start serves the unmeasured default and never waits for it, the next
    start serves the winner. Made BEFORE serve confines itself to its engine cores: it keeps the
    cores and the environment of that moment, so the race's engines run on every core with every
    thread, as its cache key says. `stop()` ends it with serve (the race also ends itself when its
    parent is gone: engine_race main)."""

    def __init__(self, bases: list[str]):
        from collab_app.cpu.cores import usable_cores

        self.bases, self.cores, self.env = bases, usable_cores(), dict(os.environ)
        self.proc: subprocess.Popen | None = None
        self._stopped = threading.Event()

    @classmethod
    def wanted(cls, cfg: ServeConfig, bases: list[str]) -> "BackgroundRace | None":
        """One for the bases that need a race, or None: an engine chosen by hand (--engine,
        COLLAB_ENGINE), a remote one, a GPU, COLLAB_CALIBRATE=0, or every race cached."""
        if cfg.engine != "auto" or remote_engine_url(cfg) or os.environ.get("COLLAB_ENGINE", "auto") != "auto":
            return None
        from collab_app.engines.choose import race_missing

        missing = race_missing(bases)
        if not missing:
            return None
        log.info("engine race: not run on this machine yet; it runs in the background %.0f s after the page is up "
                 "(this start serves the default engine, the next one the winner)", RACE_AFTER_S)
        return cls(missing)

    def _in_child(self) -> None:   # preexec: niced, on the cores serve had before its split
        if hasattr(os, "nice"):
            os.nice(10)
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cores)

    def start(self, after_s: float = RACE_AFTER_S) -> None:
        def run():
            if self._stopped.wait(after_s):
                return
            cmd = [sys.executable, "-m", "collab_app.engines.engine_race", *self.bases]
            self.proc = subprocess.Popen(cmd, env=self.env, start_new_session=True, preexec_fn=self._in_child)
            log.info("engine race started in the background (pid %d)", self.proc.pid)

        threading.Thread(target=run, daemon=True, name="engine-race").start()

    def stop(self) -> None:
        """End the race if it still runs (its own session: the race and its engines' children)."""
        self._stopped.set()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def trainer_lora_rank(cfg: ServeConfig) -> int:
    """The LoRA rank the child trainer's adapters will have (`--lora-r` in --trainer-args, else the
    trainer's default), at least 8 (vLLM's GPU LoRA takes 1, 8, 16, 32, ...): vLLM serves adapters
    up to its `max_lora_rank` on GPU and in a compiled CPU engine's in-graph slots."""
    import argparse

    from trainer.config import MAGRPOConfig

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--lora-r", type=int, default=MAGRPOConfig.lora_r)
    return max(8, parser.parse_known_args(shlex.split(cfg.trainer_args))[0].lora_r)


def engine_kwargs(cfg: ServeConfig) -> dict:
    """make_engine's keywords from cfg beyond kind and model: the retry window where the engine is a
    vLLM server (`remote_engine_url`); for the in-process engines, the transformers engine's decode
    thread (requests arrive on many server threads: engine_hf's doc, "Threads"; vLLM ignores it),
    vLLM's `max_lora_rank` (`trainer_lora_rank`) and, where --vllm-compile is not auto, vLLM's
    `enforce_eager` (the transformers engine drops both)."""
    if remote_engine_url(cfg):
        return {"retry_s": cfg.engine_retry_s}
    kw = {"decode_thread": True, "max_lora_rank": trainer_lora_rank(cfg)}
    if cfg.vllm_compile != "auto":
        kw["enforce_eager"] = cfg.vllm_compile == "off"
    return kw


PRIVATE_UMASK = 0o077


def serve(cfg: ServeConfig) -> None:
    # first: everything this process and its children create is private (store, adapters, caches)
    os.umask(PRIVATE_UMASK)
    from collab_app.web.access import check_admin_token, hf_login_available
    from collab_app.web.context import build_context, is_public

    check_admin_token(os.environ.get("COLLAB_ADMIN_TOKEN") or None)   # before the model loads
    check_weak_sandbox(cfg)                                              # and before anything is created
    check_unconfined_sandbox(cfg)
    check_loopback_admin(cfg)
    check_login(cfg)
    from collab_app.web.identity import session_secret
    # read once and dropped from the environment before any child starts (the trainer never needs it)
    signing_key = session_secret()
    api_cfg = api_config(cfg)                                            # bad API keys too
    # the other secrets: read once, dropped from os.environ, and this process non-dumpable, before
    # any child, engine or thread pool starts (module doc; collab_app/secret_env.py)
    from collab_app.secret_env import mask_url, seal
    held = seal()
    admin_token = held.get("COLLAB_ADMIN_TOKEN") or None
    if cfg.loopback_admin:
        log.warning("--loopback-admin: clients on this machine are admin without a token")
    from collab_app.engines.model import ensure_model
    from collab_app import paths
    from collab_app.web.ui import launch

    db = cfg.db or held.get("COLLAB_DB") or paths.store_url()
    adapters_dir = cfg.adapters_dir or paths.adapters_dir()
    model_path = ensure_model(cfg.model or None)   # once, before the child would race for it (HF token: secret_env.hf_token)
    agent_models = {m.partition("=")[0]: ensure_model(m.partition("=")[2]) for m in cfg.agent_models}
    check_agent_roles(agent_models, cfg.tasks)
    child = lease_dir = lease_path = None
    race = BackgroundRace.wanted(cfg, [model_path, *agent_models.values()])   # before the split: its cores
    if cfg.trainer == "child":
        # Cores are given out, never shared: OpenMP barriers of two torch processes on the same
        # cores spin against each other (a 16 s step took 9+ min beside rounds). docs/CPU.md.
        from collab_app.cpu.cores import apply_to_serving, plan

        # with a remote engine (--engine-url, COLLAB_ENGINE=URL) the generating engine is another
        # process (or machine): no split here
        split = None if remote_engine_url(cfg) else plan(cfg.engine_cores)
        argv = trainer_argv(cfg, adapters_dir, model_path, agent_models)
        if split is not None:
            apply_to_serving(split)   # before the engine or any thread starts: they inherit it
            log.info("CPU split: %s", split.describe())
            if cfg.borrow_cores:   # the engine decodes on the child's cores between its steps
                lease_dir = tempfile.mkdtemp(prefix="collab-cores-")
                lease_path = os.path.join(lease_dir, "trainer-cores.lock")
                argv += ["--core-lease", lease_path]
                if cfg.lend_engine_cores:   # it widens only once the engine says it takes part (lend_trainer_cores)
                    argv += ["--borrow-engine-cores", ",".join(map(str, split.engine))]
        child = ChildTrainer(argv, cores=split.trainer if split else None, env=trainer_env(db),
                             load_on=split.engine + split.trainer if split else None).start()
    elif cfg.trainer == "external":
        log.info("trainer: external; run `collab trainer --db %s --adapters-dir %s` on the same store "
                 "(or the URL in COLLAB_DB)", mask_url(db), adapters_dir)
    watcher = None
    ctx = None
    try:
        ctx = build_context(model=model_path, engine=cfg.engine_url or cfg.engine, store_url=db, task_names=tuple(cfg.tasks),
                            num_generations=cfg.num_generations, max_new_tokens=cfg.max_new_tokens,
                            temperature=cfg.temperature, public=is_public(cfg.host, cfg.share), adapters_dir=adapters_dir,
                            limits={"max_rounds_per_minute": cfg.max_rounds_per_minute,
                                    "max_ratings_per_minute": cfg.max_ratings_per_minute,
                                    "max_rounds_in_flight": cfg.max_rounds_in_flight,
                                    "max_rounds_in_flight_per_network": cfg.max_rounds_in_flight_per_network,
                                    "loopback_admin": cfg.loopback_admin,
                                    "max_new_sessions_per_minute": cfg.max_new_sessions_per_minute,
                                    "max_rounds_per_minute_per_network": cfg.max_rounds_per_minute_per_network,
                                    "max_ratings_per_minute_per_network": cfg.max_ratings_per_minute_per_network,
                                    "max_ratings_per_minute_global": cfg.max_ratings_per_minute_global,
                                    "require_login_to_rate": cfg.require_login_to_rate,
                                    "anonymous_share": cfg.anonymous_share if hf_login_available() else 1.0,
                                    "page_update_s": cfg.page_update_s,
                                    "session_secret": signing_key},
                            admin_token=admin_token, agent_models=agent_models, **engine_kwargs(cfg))
        ctx.trainer_child = child   # the Training tab says why it is not training (ChildTrainer.describe)
        if lease_path:
            from collab_app.cpu.lending import lend_trainer_cores

            n = lend_trainer_cores(ctx.engine, split, lease_path, cfg.lend_engine_cores)
            log.info("the engine borrows the trainer child's cores %s between its steps (%d engine part%s)",
                     ",".join(map(str, split.trainer)), n, "" if n == 1 else "s")
            if os.path.exists(lease_path + ".engine"):
                log.info("the trainer child's steps also work on the engine's cores %s between rounds",
                         ",".join(map(str, split.engine)))
        # the context's own watcher (the batcher polls it before each engine call), now also
        # on a timer: one set of "served / failed / not visible yet" state, not two
        watcher = ctx.adapter_watcher()
        watcher.interval_s = cfg.swap_interval_s
        watcher.start()
        from collab_app.web.core import warm_up
        took = warm_up(ctx)   # before the page opens: the first person's round is not the engine's first
        if took is not None:
            log.info("engine warm-up: one short batch in %.1f s", took)
        from collab_app.web.openai_api import openai_routes
        if race is not None:
            race.start()   # its clock runs from here: launch() opens the page within a second
        launch(ctx, server_name=cfg.host, server_port=cfg.port, share=cfg.share,
               app_kwargs={"routes": openai_routes(ctx, api_cfg)})
    finally:
        if race is not None:
            race.stop()
        if watcher is not None:
            watcher.stop()
        if child is not None:
            child.stop()
        if ctx is not None:
            ctx.engine.close()
        if lease_dir is not None:
            shutil.rmtree(lease_dir, ignore_errors=True)


def api_config(cfg: ServeConfig):
    """The OpenAI-compatible API's settings (collab_app/web/openai_api.py); ValueError on a
    missing keys file or a weak key."""
    from collab_app.web.openai_api import OpenAIConfig, load_api_keys

    return OpenAIConfig(api_keys=load_api_keys(cfg.api_keys_file),
                        max_rounds_per_minute=cfg.api_max_rounds_per_minute,
                        max_ratings_per_minute=cfg.api_max_ratings_per_minute)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def prepare_serving_process() -> None:
    """A serving process's CPU settings, before anything imports torch (collab_app/cpu/process.py):
    the OpenMP spin and compile caches of every command, and huge pages for its tensors."""
    process.prepare(paths.compile_cache_dir())
    process.huge_pages_for_serving()
    sandbox.set_cpu_budget(cpu_budget)


def cli_main(argv: list[str] | None = None) -> int:
    prepare_serving_process()
    from trainer.configcli import parse_config

    cfg, _ = parse_config(ServeConfig, argv, prog="collab serve",
                          description="Serve the app: engine, Gradio UI, trainer service and adapter hot-swap.")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s %(message)s")
    # SIGTERM (docker stop, systemd) takes the same clean path as Ctrl-C: the child trainer is stopped.
    from collab_app.web.access import check_admin_token
    try:
        check_admin_token(os.environ.get("COLLAB_ADMIN_TOKEN") or None)
        check_weak_sandbox(cfg)
        check_unconfined_sandbox(cfg)
        check_loopback_admin(cfg)
        check_login(cfg)
        api_config(cfg)
    except ValueError as e:   # a weak admin token or API key, weak isolation in public: say why, no traceback
        print(f"collab serve: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve(cfg)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())

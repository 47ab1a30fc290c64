"""The Gradio app's layout: `build_app(ctx) -> gr.Blocks`; `launch(ctx, ...)` queues and serves it.

Tabs: Co-code, Co-write (generate G >= 2 joint answers, see who wrote what, rate 1-5, another
round with the task's feedback; each only where the server serves such a task, `served_kinds`),
Arena (two team states answer one prompt unlabelled; one click votes, reveals them and starts the
next pair), Team, Training (with the arena's leaderboard), Data. A round that fails ends with its
message in the status line (handlers.round_events), never "starting ..." for good. All logic is
in handlers.py (and the cores behind it, core.py and arena.py); this file only maps components to
handler arguments and results to component updates.

API endpoints (gradio_client): `/generate`, `/rate`, `/rank`, `/pick_best`, `/stats` (see `_api`).
The UI's own events are private to the browser (`api_visibility="private"`) because they carry
UI-shaped outputs. `/generate` returns the final round (its streaming is the page's); a client
rates with the same `Client` (same session) that generated, or with the admin token. A script
that submits the next call the moment an answer arrives can have it cancelled by gradio_client
itself (its stream race: `collab_app.commands.bench_online.settle`); `bench_online.predict` is
`client.predict` without it.

Who rates is never typed: the rater id is the Gradio session (or the Hugging Face login on a
Space with OAuth: a "Sign in" button appears there).

In public: the Co-code tab shows the sandbox's isolation and offers "My own coding problem" only
where the sandbox allows untrusted code (else it says why and how to fix it) and a coding team is
served. The Training tab's timer runs only while that tab is selected, and its status, figures and
leaderboard come from one shared computation per TTL (handlers.training_view,
handlers.arena_board_view). Admin actions pass the caller (its address, for loopback admin and the
wrong-guess lockout). `/export` (admin token) hands out
files written to a temp dir removed after Gradio copied them to its cache; that cache's copies are
deleted after an hour (`delete_cache`). Nothing under COLLAB_HOME is ever in `allowed_paths`.
"""
from __future__ import annotations

import time

import gradio as gr

from collab_app.web import handlers as H
from collab_app.web.access import hf_login_available
from collab_app.web.context import AppContext

PRIVATE = {"api_visibility": "private"}
GENERATE = "generate"
"""the concurrency id of every event that generates a round (the page's buttons and /generate)."""
ADMIN_DOOR = {"queue": False, "api_visibility": "undocumented"}
"""Admin events (edit team, pin / roll back / unpin, pause / resume, own-problem training) run
outside Gradio's queue: its `max_size` counts every waiting event, so a full generate queue would
otherwise answer an admin's roll-back with "queue full". They are cheap (a store
write, an adapter load the hot-swap watcher would do anyway), token-checked (access.check_admin),
and callable at /gradio_api/run/<api_name> (undocumented: not listed in the API page).
ADMIN_FOLLOW: the view refresh chained after one, outside the queue too."""
ADMIN_FOLLOW = {"queue": False, "api_visibility": "private"}
RATING_CHOICES = ["1", "2", "3", "4", "5"]
INTRO = """# collab — a team of small LLM agents that learns from you
Pick a task, press **Generate**: the team writes **{G}** joint answers side by side (each agent
writes its part, with its own LoRA adapter; you see them as they are written). Rate each
candidate **1-5** (5 = best), or **pick the best**, or **rank** them all; ratings and the
automatic checks become rewards for the next MAGRPO training step. You can rate only the
candidates your own session generated."""


def _err(fn):
    """UserError -> gr.Error (a message in the UI / an AppError for API clients); the app stays up.
    A person's input mistake is no fault of the server: Gradio prints no traceback for it."""
    import functools
    import inspect

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen(*a, **k):
            try:
                yield from fn(*a, **k)
            except H.UserError as e:
                raise gr.Error(str(e), print_exception=False) from None
        return gen

    @functools.wraps(fn)
    def wrapped(*a, **k):
        try:
            return fn(*a, **k)
        except H.UserError as e:
            raise gr.Error(str(e), print_exception=False) from None
    return wrapped


class _Panel:
    """The candidates area of a tab: status line, G candidates one below the other, each with its
    agents' parts side by side (one column per agent: `width` columns, the most agents of the tab's
    teams; a team of fewer agents leaves the rest hidden), its automatic checks and a 1-5 rating
    once it is checked (text streams in); comment + Submit, "pick the best", "rank", and "another
    round"."""

    def __init__(self, ctx: AppContext, name: str, width: int):
        self.ctx, self.coding, self.width = ctx, name == "code", width
        G = ctx.max_generations
        self.status = gr.Markdown("", elem_id=f"{name}-status")
        self.columns, self.heads, self.parts, self.checks, self.ratings = [], [], [], [], []
        for i in range(G):
            with gr.Column(visible=False, elem_id=f"{name}-cand-{i}") as col:
                self.heads.append(gr.Markdown(elem_id=f"{name}-cand-{i}-head"))
                with gr.Row(equal_height=False):
                    self.parts.append([gr.Markdown(elem_id=f"{name}-cand-{i}-part-{a}", min_height=0)
                                       for a in range(width)])
                self.checks.append(gr.Markdown(elem_id=f"{name}-cand-{i}-checks"))
                self.ratings.append(gr.Radio(RATING_CHOICES, label=f"your rating of candidate {i + 1}",
                                             visible=False, elem_id=f"{name}-rate-{i}"))
            self.columns.append(col)
        with gr.Row(visible=False) as self.rate_row:
            self.comment = gr.Textbox(label="comment (optional, kept with any feedback below)", scale=3,
                                      max_lines=3)
            self.submit = gr.Button("Submit ratings", variant="primary", scale=1, elem_id=f"{name}-submit")
        with gr.Row(visible=False, equal_height=False) as self.forms_row:
            with gr.Column(scale=1, min_width=240):
                self.best = gr.Radio([], label="or: pick the best candidate", elem_id=f"{name}-best")
                self.best_btn = gr.Button("Submit pick", elem_id=f"{name}-pick")
            with gr.Column(scale=2, min_width=320):
                with gr.Row():
                    self.ranks = [gr.Dropdown([], value=None, label=f"rank of candidate {i + 1} (1 = best)",
                                              visible=False, min_width=120, elem_id=f"{name}-rank-{i}")
                                  for i in range(G)]
                self.rank_btn = gr.Button("Submit ranking", elem_id=f"{name}-rank")
        self.rate_msg = gr.Markdown(elem_id=f"{name}-rate-msg")
        with gr.Row(visible=False) as self.round_row:
            self.continue_from = gr.Dropdown(label="continue from candidate (default: best automatic score)",
                                             choices=[], value=None, scale=2)
            self.again = gr.Button("Another round (with the checks' feedback)", scale=1, elem_id=f"{name}-again")

    def outputs(self):
        return [self.status, *self.columns, *self.heads, *(p for row in self.parts for p in row), *self.checks,
                *self.ratings, self.rate_row, self.forms_row, self.best, *self.ranks, self.rate_msg, self.round_row,
                self.continue_from]

    def done(self, ep: dict, message: str) -> dict:
        """The stored round: every form of feedback opens."""
        K = len(ep["candidates"])
        upd = {self.status: message, self.rate_msg: "", self.rate_row: gr.update(visible=True),
               self.forms_row: gr.update(visible=True), self.round_row: gr.update(visible=True),
               self.best: gr.update(choices=[(f"candidate {i + 1}", i + 1) for i in range(K)], value=None),
               self.continue_from: gr.update(choices=[(f"candidate {i + 1}", i) for i in range(K)], value=None)}
        for i in range(self.ctx.max_generations):
            upd[self.ranks[i]] = gr.update(visible=i < K, choices=list(range(1, K + 1)), value=None)
            upd[self.ratings[i]] = gr.update(visible=i < K)
        return upd

    def hide(self, message: str) -> dict:
        upd = {self.status: message, self.rate_row: gr.update(visible=False),
               self.forms_row: gr.update(visible=False), self.round_row: gr.update(visible=False),
               self.rate_msg: ""}
        upd.update({c: gr.update(visible=False) for c in self.columns})
        upd.update({c: "" for c in (*self.heads, *self.checks, *(p for row in self.parts for p in row))})
        upd.update({r: gr.update(visible=False, value=None) for r in self.ratings})
        return upd

    def markdowns(self) -> list:
        """The panel's Markdown outputs (text that changes during a round)."""
        return [self.status, self.rate_msg, *self.heads, *self.checks, *(p for row in self.parts for p in row)]

    def stream(self, ep: dict, state, request: gr.Request | None):
        """Run the handler's generator: the cards follow the candidates as they are written and
        checked, a candidate's rating appears once it is checked (the person may pick stars while
        the others are still written; Submit opens when the group is stored), and the stored round
        opens every form.

        Each update names every Markdown output with its current text, changed or not, and leaves
        the other outputs alone (gr.skip(), by omission): Gradio 6.31 rebuilds each output left
        alone (~0.6 ms of Python, GIL held, beside the in-process engine) where a plain value
        costs it a postprocess (~0.13 ms), and it sends the page only what changed (its stream
        diff). The ratings, dropdowns and rows stay left alone, so a rating the person picked
        mid-round is never reset."""
        yield self.hide("*starting ...*")
        shown = dict.fromkeys(self.markdowns(), "")        # component -> text on the page (hide() cleared them)
        seen: set[int] = set()
        rating_on: set[int] = set()
        for ev in H.round_events(self.ctx, ep, _caller(request), min_update_s=self.ctx.page_update_s):
            if ev["kind"] == "failed":                     # the round ends here, saying why (H.round_events)
                yield self.hide(("**Round stopped**: " if ev["user_error"] else "**Round failed**: ")
                                + H.md_literal(ev["message"]))
                return
            done = ev["kind"] == "done"
            cands = ev["episode"]["candidates"] if done else ev["candidates"]
            upd: dict = {}
            for i, c in enumerate(cands):
                shown[self.heads[i]] = H.render_head(c, i)
                shown[self.checks[i]] = H.render_checks(c)
                for a, p in enumerate(c["parts"]):
                    shown[self.parts[i][a]] = H.render_part(p, self.coding)
                if i not in seen:                          # first sight: the card and one column per agent
                    seen.add(i)
                    upd[self.columns[i]] = gr.update(visible=True)
                    for a, part in enumerate(self.parts[i]):
                        upd[part] = gr.update(value=shown[part], visible=a < len(c["parts"]))
                if c["state"] == "checked" and i not in rating_on:
                    rating_on.add(i)
                    upd[self.ratings[i]] = gr.update(visible=True)
            shown[self.status] = f"*{ev['message']}*"
            if done:
                final = self.done(ev["episode"], f"**{ev['message']}**")
                shown.update({comp: final.pop(comp) for comp in (self.status, self.rate_msg)})
                upd.update(final)
                upd[state] = ev["episode"]
            for comp, md in shown.items():
                upd.setdefault(comp, md)
            yield upd

    def wire(self, state, start_fn, start_inputs, generate_btn):
        outs = self.outputs() + [state]

        @_err
        def on_generate(request: gr.Request, *args):
            # gr.Request must be positional (Gradio injects it by position, not after *args)
            *inputs, _state = args
            ep = start_fn(*inputs)
            yield from self.stream(ep, state, request)

        @_err
        def on_again(request: gr.Request, ep, continue_from):
            ep = H.another_round(self.ctx, ep, None if continue_from in (None, "") else int(continue_from))
            yield from self.stream(ep, state, request)

        @_err
        def on_submit(request: gr.Request, ep, comment, *values):
            return H.rate_candidates(self.ctx, ep, list(values), _caller(request), comment)

        @_err
        def on_pick(request: gr.Request, ep, comment, best):
            return H.pick_best(self.ctx, (ep or {}).get("group_id"), best, _caller(request), comment)

        @_err
        def on_rank(request: gr.Request, ep, comment, *ranks):
            K = len((ep or {}).get("candidates") or [])
            return H.rank(self.ctx, (ep or {}).get("group_id"), list(ranks[:K]), _caller(request), comment)

        # show_progress hidden: the status line says what the round does; Gradio's own overlay and
        # timer on each of the ~35 outputs cost the person's browser ~40% more CPU per round
        gen_kw = dict(concurrency_id=GENERATE, concurrency_limit=self.ctx.generate_concurrency,
                      show_progress="hidden", **PRIVATE)
        generate_btn.click(on_generate, start_inputs + [state], outs, **gen_kw)
        self.again.click(on_again, [state, self.continue_from], outs, **gen_kw)
        rate_kw = dict(concurrency_limit=8, **PRIVATE)
        self.submit.click(on_submit, [state, self.comment, *self.ratings], [self.rate_msg], **rate_kw)
        self.best_btn.click(on_pick, [state, self.comment, self.best], [self.rate_msg], **rate_kw)
        self.rank_btn.click(on_rank, [state, self.comment, *self.ranks], [self.rate_msg], **rate_kw)


def _request_state(request) -> dict:
    """The ASGI request state identity.IdentityMiddleware filled (a queued event's gr.Request
    keeps the fastapi Request of its join call, or a copy of its state once pickled)."""
    inner = getattr(request, "request", None)
    if inner is not None:
        return dict(getattr(getattr(inner, "state", None), "_state", {}) or {})
    return dict(getattr(request, "kwargs", {}).get("request_state") or {})


def _caller(request) -> H.Caller:
    """Who acts, from Gradio's request: the server-issued session identity.IdentityMiddleware
    verified (its signed cookie; never `request.session_hash`, which the client picks), the
    Hugging Face login where the Space has OAuth (gr.Request.username), the client's address
    (gr.Request.client.host, as uvicorn reports it) and its network. Nothing a person types."""
    if request is None:
        return H.Caller(None)
    from collab_app.web.identity import STATE_NETWORK, STATE_SESSION

    state = _request_state(request)
    client = getattr(request, "client", None)
    return H.Caller(state.get(STATE_SESSION), getattr(request, "username", None), getattr(client, "host", None),
                    state.get(STATE_NETWORK))


def _admin(fn):
    """An admin handler `fn(*inputs, caller=...)` as a Gradio event function: the caller comes
    from gr.Request (which must be the first parameter: Gradio injects it by position)."""
    @_err
    def event(request: gr.Request, *args):
        return fn(*args, caller=_caller(request))
    return event


def _code_tab(ctx: AppContext):
    """The Co-code tab. Returns (refresh, outputs) for page load: the sandbox re-probes a weak
    isolation (tasks.sandbox), so whether a person's own problem is offered is asked again for
    every page, not fixed when the app was built."""
    listed = H.listed_coding_tasks(ctx)   # coding tasks whose problems a person picks from (HumanEval)
    label_of = {name: H.problem_source(ctx.tasks[name]) for name in listed}
    own_served = H.own_problem_served(ctx)   # a coding team works on it: not with `--tasks tldr`

    def isolation_view():
        own_off = H.own_problem_off_message(ctx) if own_served else None   # None: their tests may run here
        return (f"<sub>sandbox isolation: {ctx.isolation_summary}</sub>", own_off,
                list(label_of.values()) + ([H.OWN_PROBLEM] if own_served and not own_off else []))

    iso_text, own_off, sources = isolation_view()
    iso_md = gr.Markdown(iso_text, elem_id="code-isolation")
    off_md = gr.Markdown(own_off or "", visible=bool(own_off), elem_id="code-own-off")
    if not sources:
        return None
    state = gr.State(H.new_episode())
    source = gr.Radio(sources, value=sources[0], label="problem", elem_id="code-source")
    boxes = []   # (task, its group, split, problem, preview) per listed coding task
    for k, name in enumerate(listed):
        title = ctx.tasks[name].title
        with gr.Group(visible=sources[0] == label_of[name]) as box:
            with gr.Row():
                split = gr.Radio(["eval", "train"], value="eval", label=f"{title} split", scale=1)
                first = H.list_examples(ctx, name, "eval")
                problem = gr.Dropdown(first, value=first[0][1] if first else None, label=f"{title} problem",
                                      scale=3, elem_id="code-problem" if k == 0 else f"code-problem-{name}")
            preview = gr.Markdown(H.example_preview(ctx, name, "eval", first[0][1]) if first else "")
        boxes.append((name, box, split, problem, preview))
    with gr.Group(visible=sources[0] == H.OWN_PROBLEM) as own_box:
        own_prompt = gr.Code(label="your problem: function signature + docstring", language="python",
                             value='def add(a, b):\n    """Return the sum of a and b."""\n', elem_id="code-own-prompt")
        own_tests = gr.Code(label="tests (assert statements, or HumanEval-style `def check(candidate)`)",
                            language="python", value="assert add(1, 2) == 3\nassert add(-1, 1) == 0\n")
        entry = gr.Textbox(label="entry point (function name; empty = the first def)", max_lines=1)
    gen = gr.Button("Generate", variant="primary", elem_id="code-generate")
    panel = _Panel(ctx, "code", _team_width(ctx, "coding"))

    source.change(lambda s: (*(gr.update(visible=s == label_of[b[0]]) for b in boxes),
                             gr.update(visible=s not in label_of.values())),
                  [source], [b[1] for b in boxes] + [own_box], **PRIVATE)

    for name, _, split, problem, preview in boxes:
        _wire_problem_list(ctx, name, split, problem, preview)

    def start(src, *args):
        n = len(boxes)
        k = next((i for i, b in enumerate(boxes) if label_of[b[0]] == src), None)
        sp, pid = (args[k], args[n + k]) if k is not None else ("eval", None)
        return H.start_coding(ctx, src, sp, pid, *args[2 * n:])
    panel.wire(state, start, [source, *(b[2] for b in boxes), *(b[3] for b in boxes), own_prompt, own_tests, entry],
               gen)

    def refresh():
        text, off, now = isolation_view()
        return (text, gr.update(value=off or "", visible=bool(off)),
                gr.update(choices=now, value=now[0]) if now else gr.update())
    return refresh, [iso_md, off_md, source]


def _wire_problem_list(ctx: AppContext, name: str, split, problem, preview) -> None:
    """A listed coding task's split picks its problems; the problem picked shows its prompt."""
    @_err
    def on_split(sp):
        ch = H.list_examples(ctx, name, sp)
        return gr.update(choices=ch, value=ch[0][1] if ch else None)
    split.change(on_split, [split], [problem], **PRIVATE)
    problem.change(_err(lambda sp, pid: H.example_preview(ctx, name, sp, pid) if pid else ""),
                   [split, problem], [preview], **PRIVATE)


def _team_width(ctx: AppContext, kind: str) -> int:
    """Columns a tab's round view needs: the most agents of its tasks' teams (a person's own
    coding problem is worked on by a coding task's team, so it needs no column of its own)."""
    return max((len(ctx.team_for(n).agents) for n, t in ctx.tasks.items() if t.kind == kind), default=1)


def served_kinds(ctx: AppContext) -> dict[str, bool]:
    """Which round tabs the page has: Co-code where a coding task is served (HumanEval, or a
    person's own problem, which a coding team works on), Co-write where a writing task is. A tab
    for what the server does not serve would fail at Generate (no team for its task)."""
    choices = H.task_choices(ctx)
    return {"coding": bool(choices["coding"]), "writing": bool(choices["writing"])}


def _write_tab(ctx: AppContext):
    names = H.task_choices(ctx)["writing"]
    state = gr.State(H.new_episode())
    # a task's label is its name and its team's roles (the task says them; no list of names here)
    task = gr.Radio([(f"{n}: {' + '.join(ctx.tasks[n].roles)}", n) for n in names], value=names[0] if names else None,
                    label="writing task", elem_id="write-task")
    first = H.writing_examples(ctx, names[0]) if names else []
    sample = gr.Dropdown(first, value=None, label="or start from one of the project's texts")
    text = gr.Textbox(label="your text (paste it here)", lines=8, max_lines=20, elem_id="write-text",
                      placeholder="Paste a paragraph, an abstract, a post ...")
    task.change(lambda t: gr.update(choices=H.writing_examples(ctx, t), value=None), [task], [sample], **PRIVATE)
    sample.change(_err(lambda t, i: H.writing_example_text(ctx, t, i) if i else gr.update()), [task, sample],
                  [text], **PRIVATE)
    gen = gr.Button("Generate", variant="primary", elem_id="write-generate")
    panel = _Panel(ctx, "write", _team_width(ctx, "writing"))
    panel.wire(state, lambda t, x: H.start_writing(ctx, t, x), [task, text], gen)


ARENA_INTRO = """Two versions of the team (say, the base model and a later training step) answer the same
prompt side by side, **unlabelled**. Pick the better answer: one click stores your vote, shows which version
wrote which, and starts the next pair. Votes rank the team's versions on the leaderboard in the Training tab;
they do not train the team."""


def _arena_tab(ctx: AppContext):
    """The blind arena: a task, an optional own text, "New pair"; answers A and B side by side with
    nothing that names their team state; one click on a vote button stores the vote, reveals the
    labels (result line) and streams the next pair on the same task (a chained event in the
    generate group). Handlers: H.arena_pair_events / arena_vote_view / arena_next_events."""
    choices = H.arena_task_choices(ctx)
    state = gr.State(H.arena_new_state())
    gr.Markdown(ARENA_INTRO)
    with gr.Row(equal_height=True):
        task = gr.Dropdown(choices, value=choices[0][1] if choices else None, label="task", scale=3,
                           elem_id="arena-task")
        new = gr.Button("New pair", variant="primary", scale=1, elem_id="arena-new")
    text = gr.Textbox(label="your own text — writing tasks; leave empty for one of the task's held-out "
                            "texts/problems", lines=3, max_lines=12, elem_id="arena-text")
    prompt = gr.Markdown(elem_id="arena-prompt")
    status = gr.Markdown(elem_id="arena-status")
    with gr.Row(equal_height=False):
        with gr.Column(elem_id="arena-col-a"):
            gr.Markdown("### A")
            a = gr.Markdown(elem_id="arena-a", min_height=0)
        with gr.Column(elem_id="arena-col-b"):
            gr.Markdown("### B")
            b = gr.Markdown(elem_id="arena-b", min_height=0)
    with gr.Row():
        buttons = {w: gr.Button(label, interactive=False, elem_id=f"arena-vote-{w}")
                   for w, label in (("a", "A is better"), ("tie", "Tie"), ("b", "B is better"))}
    result = gr.Markdown(elem_id="arena-result")
    votes = list(buttons.values())
    pair_outs = [status, prompt, a, b, *votes, state]

    def show(views):
        """Page updates from the handler's views: the Markdown every time (plain values, as
        _Panel.stream), the buttons and the state only where a view changes them."""
        for v in views:
            upd = {status: v["status"], a: v["a"], b: v["b"]}
            if v["prompt"] is not None:
                upd[prompt] = v["prompt"]
            if v["kind"] != "progress":
                upd.update({btn: gr.update(interactive=v["can_vote"]) for btn in votes})
            if v["state"] is not None:
                upd[state] = v["state"]
            yield upd

    @_err
    def on_new(request: gr.Request, task_name, own_text, st):
        yield from show(H.arena_pair_events(ctx, _caller(request), task_name, own_text, st, ctx.page_update_s))

    @_err
    def on_next(request: gr.Request, st):
        yield from show(H.arena_next_events(ctx, _caller(request), st, ctx.page_update_s))

    def on_vote(winner):
        @_err
        def vote(request: gr.Request, st):
            v = H.arena_vote_view(ctx, _caller(request), st, winner)
            return {result: v["result"], state: v["state"],
                    **{btn: gr.update(interactive=v["can_vote"]) for btn in votes}}
        return vote

    # generating a pair is a round: the generate group, so the per-network share before Gradio
    # (identity middleware) and the slots hold for it too; the vote itself is a rating-sized event
    gen_kw = dict(concurrency_id=GENERATE, concurrency_limit=ctx.generate_concurrency, show_progress="hidden",
                  **PRIVATE)
    new.click(on_new, [task, text, state], pair_outs, **gen_kw)
    for w, btn in buttons.items():
        btn.click(on_vote(w), [state], [result, state, *votes], concurrency_limit=8, show_progress="hidden",
                  **PRIVATE).success(on_next, [state], pair_outs, **gen_kw)


def _team_tab(ctx: AppContext, token):
    overview = gr.Markdown(H.team_overview(ctx), elem_id="team-overview")
    agents = H.agent_choices(ctx)
    with gr.Accordion("Role prompts (admin)", open=False):
        agent = gr.Dropdown(agents, value=agents[0] if agents else None, label="agent")
        prompt = gr.Textbox(H.role_prompt(ctx, agents[0]) if agents else "", label="role prompt (system)",
                            lines=4)
        save_prompt = gr.Button("Save role prompt")
    with gr.Accordion("Generation settings (admin)", open=False):
        with gr.Row():
            G = gr.Slider(2, ctx.max_generations, value=ctx.num_generations, step=1,
                          label="number of generations G")
            temp = gr.Slider(0, 2, value=ctx.sampling.temperature, step=0.05, label="temperature")
            top_p = gr.Slider(0.05, 1, value=ctx.sampling.top_p, step=0.05, label="top-p")
            max_new = gr.Number(ctx.sampling.max_new_tokens, precision=0, label="max new tokens")
        save_gen = gr.Button("Apply")
    with gr.Accordion("Adapter versions: pin / roll back (admin)", open=True):
        with gr.Row():
            ad_agent = gr.Dropdown(agents, value=agents[0] if agents else None, label="agent", scale=2)
            version = gr.Number(None, precision=0, label="version to pin", scale=1)
        versions = gr.Dataframe(H.adapter_table(ctx, agents[0]) if agents else None, interactive=False,
                                headers=H.ADAPTER_HEADERS, label="versions (newest first)")
        with gr.Row():
            pin = gr.Button("Pin this version")
            back = gr.Button("Roll back one version")
            unpin = gr.Button("Unpin (follow the trainer's newest)")
    msg = gr.Markdown(elem_id="team-msg")

    def refresh(a):
        return H.team_overview(ctx), H.adapter_table(ctx, a)

    agent.change(lambda a: H.role_prompt(ctx, a), [agent], [prompt], **PRIVATE)
    ad_agent.change(lambda a: H.adapter_table(ctx, a), [ad_agent], [versions], **PRIVATE)
    save_prompt.click(_admin(lambda t, a, p, caller: H.set_role_prompt(ctx, t, a, p, caller=caller)),
                      [token, agent, prompt], [msg], api_name="set_role_prompt", **ADMIN_DOOR
                      ).then(lambda: H.team_overview(ctx), None, [overview], **ADMIN_FOLLOW)
    save_gen.click(_admin(lambda t, g, te, tp, mx, caller: H.set_generation_settings(ctx, t, g, te, tp, mx,
                                                                                       caller=caller)),
                   [token, G, temp, top_p, max_new], [msg], api_name="set_generation_settings", **ADMIN_DOOR
                   ).then(lambda: H.team_overview(ctx), None, [overview], **ADMIN_FOLLOW)
    for btn, name, fn in ((pin, "pin_adapter", lambda t, a, v, caller: H.pin_adapter(ctx, t, a, v, caller=caller)),
                          (back, "roll_back", lambda t, a, v, caller: H.roll_back(ctx, t, a, caller=caller)),
                          (unpin, "unpin_adapter", lambda t, a, v, caller: H.unpin_adapter(ctx, t, a, caller=caller))):
        # a swap mid-round is safe: engines take adapter loads under their own lock, as they do
        # the hot-swap watcher's (which runs on a timer beside rounds anyway)
        btn.click(_admin(fn), [token, ad_agent, version], [msg], api_name=name, **ADMIN_DOOR
                  ).then(refresh, [ad_agent], [overview, versions], **ADMIN_FOLLOW)
    return refresh, [ad_agent], [overview, versions]


def _training_tab(ctx: AppContext, token):
    status = gr.Markdown(H.training_status(ctx), elem_id="train-status")
    with gr.Row():
        pause = gr.Button("Pause training (admin)")
        resume = gr.Button("Resume training (admin)")
    with gr.Row():
        allow_own = gr.Button("Let people's own coding problems train the team (admin)")
        deny_own = gr.Button("Keep people's own coding problems out of training (admin)")
    msg = gr.Markdown(elem_id="train-msg")
    with gr.Accordion("Set-aside and expired groups (admin)", open=False):
        gr.Markdown("Groups that will not train as they stand, with why. Put back those closed by a fault "
                    "that is mended (a full disk, a broken step): they are open again and train once they "
                    "have their returns.")
        show_closed = gr.Button("Show them (admin)", elem_id="train-closed-show")
        closed = gr.Dataframe(interactive=False, headers=H.CLOSED_HEADERS, label="newest first",
                              elem_id="train-closed")
        with gr.Row():
            put_ids = gr.Textbox(label="group ids to put back, e.g. 12, 15", max_lines=1, scale=3,
                                 elem_id="train-put-ids")
            put_back = gr.Button("Put back (admin)", scale=1, elem_id="train-put-back")
    with gr.Row(equal_height=False, elem_id="train-curves"):
        with gr.Column(scale=3):
            gr.Markdown("#### Return and reward levels per training step")
            levels_plot = gr.Plot(show_label=False)
        with gr.Column(scale=2):
            gr.Markdown("#### Graded by people: each team state's rating from the Arena's blind votes")
            arena_plot = gr.Plot(show_label=False, elem_id="train-arena-plot")
    arena_md = gr.Markdown(H.ARENA_NO_VOTES, elem_id="train-arena-votes")
    arena_table = gr.Dataframe(interactive=False, headers=H.ARENA_BOARD_HEADERS, elem_id="train-arena-board",
                               label="leaderboard (Bradley–Terry rating on an Elo-like scale, 95% bootstrap interval; "
                                     "W / L / T = wins / losses / ties)")
    gr.Markdown("#### Learning signal: zero-variance groups, human vs automatic reward")
    signal_plot = gr.Plot(show_label=False)
    # ticks only while this tab is selected (build_app: its select activates, the others' stop it)
    timer = gr.Timer(ctx.training_refresh_s, active=False)
    outs = [status, levels_plot, signal_plot, arena_md, arena_table, arena_plot]
    render = levels_plot.postprocess   # figure -> PlotData (PNG), once per TTL for every page

    def refresh():
        return (*H.training_view(ctx, render), *H.arena_board_view(ctx, render))
    timer.tick(refresh, None, outs, concurrency_limit=4, show_progress="hidden", **PRIVATE)
    pause.click(_admin(lambda t, caller: H.set_training_paused(ctx, t, True, caller=caller)), [token], [msg],
                api_name="pause_training", **ADMIN_DOOR).then(refresh, None, outs, **ADMIN_FOLLOW)
    resume.click(_admin(lambda t, caller: H.set_training_paused(ctx, t, False, caller=caller)), [token], [msg],
                 api_name="resume_training", **ADMIN_DOOR).then(refresh, None, outs, **ADMIN_FOLLOW)
    show_closed.click(_admin(lambda t, caller: H.closed_groups_table(ctx, t, caller=caller)), [token], [closed],
                      api_name="closed_groups", **ADMIN_DOOR)
    put_back.click(_admin(lambda t, ids, caller: H.put_back_groups(ctx, t, ids, caller=caller)), [token, put_ids],
                   [msg], api_name="put_back_groups", **ADMIN_DOOR
                   ).success(refresh, None, outs, **ADMIN_FOLLOW
                             ).success(_admin(lambda t, caller: H.closed_groups_table(ctx, t, caller=caller)), [token],
                                       [closed], **ADMIN_FOLLOW)
    for btn, allowed in ((allow_own, True), (deny_own, False)):
        btn.click(_admin(lambda t, caller, a=allowed: H.set_custom_training(ctx, t, a, caller=caller)), [token],
                  [msg], api_name="allow_own_training" if allowed else "deny_own_training", **ADMIN_DOOR).then(refresh, None, outs, **ADMIN_FOLLOW)
    return refresh, outs, timer


def _data_tab(ctx: AppContext, token):
    stats = gr.Markdown(H.data_stats(ctx), elem_id="data-stats")
    with gr.Row():
        everyone = gr.Checkbox(False, label="all sessions (admin; default: only yours)")
        refresh_btn = gr.Button("Refresh")
    table = gr.Dataframe(interactive=False, headers=H.GROUP_HEADERS, label="recent groups", elem_id="data-groups")
    with gr.Row():
        formats = gr.CheckboxGroup(["jsonl", "parquet", "datasets"], value=["jsonl"], label="export formats")
        export_btn = gr.Button("Export everything (admin)")
    files = gr.File(label="export", file_count="multiple", interactive=False, height=120)

    @_err
    def refresh(request: gr.Request, all_, t):
        caller = _caller(request)
        return H.data_stats(ctx), H.recent_groups_table(ctx, caller.session_id, all_, t, caller=caller)

    @_err
    def export(request: gr.Request, admin_token: str, export_formats: list[str]):
        # a generator: Gradio copies the yielded files into its cache before it resumes it, and
        # resuming ends `exported`, which removes the temp dir
        with H.exported(ctx, admin_token, export_formats, caller=_caller(request)) as paths:
            yield paths
    refresh_btn.click(refresh, [everyone, token], [stats, table], concurrency_limit=8, **PRIVATE)
    everyone.change(refresh, [everyone, token], [stats, table], **PRIVATE)
    # an API endpoint too (/export, admin token): scripts can fetch everything
    export_btn.click(export, [token, formats], [files], api_name="export", concurrency_limit=1)
    return refresh, [everyone, token], [stats, table]


def _api(ctx: AppContext):
    """Endpoints for gradio_client / HTTP; typed so that Gradio documents them."""

    @_err
    def generate(task: str, problem: str = "", split: str = "eval", text: str = "", tests: str = "",
                 entry_point: str = "", request: gr.Request = None) -> dict:
        """One round of the team. task: a coding task such as humaneval (problem = its id), custom-coding (text = the
        problem, tests), a writing task such as tldr (text = the pasted text). Returns the group id and its
        candidates (joint_sample_id, parts per agent, automatic reward)."""
        if task in H.task_choices(ctx)["coding"]:
            src = H.OWN_PROBLEM if ctx.tasks.get(task) is None else H.problem_source(ctx.tasks[task])   # no shipped problems: your own
            ep = H.start_coding(ctx, src, split, problem, text, tests, entry_point)
        else:
            ep = H.start_writing(ctx, task, text)
        done = H.run_generate(ctx, ep, _caller(request))
        ep = done["episode"]
        return {"group_id": ep["group_id"], "message": done["message"],
                "candidates": [{k: c[k] for k in ("joint_sample_id", "parts", "combined", "reward")}
                               for c in ep["candidates"]]}

    @_err
    def rate(joint_sample_id: int, rating: int, comment: str = "", admin_token: str = "",
             request: gr.Request = None) -> str:
        """Rate one joint answer 1-5 (5 = best); only a joint answer this client's session
        generated (or any, with admin_token). The rater is this session. Returns 'rating saved: #id'
        ('rating saved, but it will not train the team (why ...): #id' for a group already closed)."""
        return H.rate_saved(ctx, joint_sample_id, rating, _caller(request), comment, admin_token)

    @_err
    def rank(group_id: int, ranks: list[int], comment: str = "", admin_token: str = "",
             request: gr.Request = None) -> str:
        """Rank all candidates of a group this session generated: ranks[k] = rank of candidate
        k + 1 (1 = best), each rank 1..G once. Returns 'ranking saved: ...'."""
        return H.rank(ctx, group_id, ranks, _caller(request), comment, admin_token)

    @_err
    def pick_best(group_id: int, best: int, comment: str = "", admin_token: str = "",
                  request: gr.Request = None) -> str:
        """Pick the best candidate (1..G) of a group this session generated. Returns 'pick saved: ...'."""
        return H.pick_best(ctx, group_id, best, _caller(request), comment, admin_token)

    def stats() -> dict:
        """Counts of groups, samples, ratings, train steps."""
        return H.stats_dict(ctx)

    gr.api(generate, api_name="generate", concurrency_id=GENERATE, concurrency_limit=ctx.generate_concurrency)
    gr.api(rate, api_name="rate", concurrency_limit=8)
    gr.api(rank, api_name="rank", concurrency_limit=8)
    gr.api(pick_best, api_name="pick_best", concurrency_limit=8)
    gr.api(stats, api_name="stats", concurrency_limit=8)


def _timer(active: bool) -> gr.Timer:
    """The Training tab's timer switched on (its tab selected) or off (another tab selected)."""
    return gr.Timer(active=active)


def build_app(ctx: AppContext) -> gr.Blocks:
    # delete_cache: Gradio's copies of served files (exports hold every session's data) are deleted
    # once older than an hour, swept every minute (at most 61 minutes old)
    with gr.Blocks(title="collab", analytics_enabled=False, delete_cache=(CACHE_SWEEP_S, EXPORT_MAX_AGE_S)) as demo:
        gr.Markdown(INTRO.format(G=ctx.num_generations))
        if ctx.storage_warning:
            gr.Markdown("**Warning:** " + ctx.storage_warning, elem_id="storage-warning")
        with gr.Row():
            if hf_login_available():
                gr.LoginButton()   # a Space with `hf_oauth: true`: ratings then carry the HF login
            token = gr.Textbox(label="admin token (only for admin actions)", type="password", max_lines=1,
                               scale=1, visible=bool(ctx.admin_token))
        served = served_kinds(ctx)
        with gr.Tabs():
            code_tab = write_tab = code_load = None
            if served["coding"]:
                with gr.Tab("Co-code", id="code") as code_tab:
                    code_load = _code_tab(ctx)
            if served["writing"]:
                with gr.Tab("Co-write", id="write") as write_tab:
                    _write_tab(ctx)
            arena_tab = None
            if H.arena_tasks(ctx):
                with gr.Tab("Arena", id="arena") as arena_tab:
                    _arena_tab(ctx)
            with gr.Tab("Team", id="team") as team_tab:
                team_refresh, team_ins, team_outs = _team_tab(ctx, token)
            with gr.Tab("Training", id="training") as train_tab:
                train_refresh, train_outs, train_timer = _training_tab(ctx, token)
            with gr.Tab("Data", id="data") as data_tab:
                data_refresh, data_ins, data_outs = _data_tab(ctx, token)
        _api(ctx)
        # versions the trainer wrote since the page was built show on load and on opening the tab
        team_tab.select(team_refresh, team_ins, team_outs, **PRIVATE)
        # the Training tab refreshes only while it is the selected one
        train_tab.select(lambda: (*train_refresh(), _timer(True)), None, train_outs + [train_timer],
                         show_progress="hidden", **PRIVATE)
        for tab in (t for t in (code_tab, write_tab, arena_tab, team_tab, data_tab) if t is not None):
            tab.select(lambda: _timer(False), None, [train_timer], show_progress="hidden", **PRIVATE)
        demo.load(data_refresh, data_ins, data_outs, **PRIVATE)
        # and on opening the tab: the rounds a person ran since the page loaded are in it
        data_tab.select(data_refresh, data_ins, data_outs, show_progress="hidden", **PRIVATE)
        if code_load:
            demo.load(code_load[0], None, code_load[1], **PRIVATE)
    return demo


MAX_FILE_SIZE = "1mb"
"""largest upload Gradio accepts (its /upload route takes files whatever the page shows; this app
has no upload field, its inputs are text)."""
EXPORT_MAX_AGE_S = 3600
CACHE_SWEEP_S = 60
"""Gradio's cache (exports included) is swept every minute for files older than an hour."""


def identity_middleware(ctx: AppContext):
    """The Starlette Middleware entry that gives every request its server-issued session
    (identity.IdentityMiddleware), for FastAPI(middleware=[...]) / launch's app_kwargs."""
    from starlette.middleware import Middleware

    from collab_app.web.identity import IdentityMiddleware
    # a public app (or one behind a proxy) refuses a network's rounds over its fair share before
    # Gradio's queue (begin_round still decides; this spares the queue and the serving core the
    # rest); a local app's one person may queue rounds past the slots that run at once
    caps = {} if ctx.trusts_its_person else {GENERATE: ctx.limits.network_cap}
    return Middleware(IdentityMiddleware, identity=ctx.identity, group_caps=caps)


def launch(ctx: AppContext, server_name: str = "127.0.0.1", server_port: int | None = None,
           share: bool = False, max_size: int | None = 64, max_file_size: str | int | None = MAX_FILE_SIZE,
           app_kwargs: dict | None = None, **launch_kw) -> gr.Blocks:
    """Queue and serve; returns the app (blocks until closed unless prevent_thread_lock=True).

    The queue holds at most `max_size` waiting events (more get "queue full"); `generate` runs
    `ctx.generate_concurrency` events at once, merged into shared engine calls; other events 4.
    Every request passes identity.IdentityMiddleware first (the caller's signed session);
    uploads over `max_file_size` get 413."""
    demo = build_app(ctx)
    demo.queue(max_size=max_size, default_concurrency_limit=4)
    app_kwargs = dict(app_kwargs or {})
    app_kwargs["middleware"] = [identity_middleware(ctx), *app_kwargs.get("middleware", [])]
    block = not launch_kw.pop("prevent_thread_lock", False)
    # Gradio's own "is localhost reachable" check (networking.url_ok, run when `_frontend` is on)
    # gives up at the FIRST 3 s timeout or refused connection of a HEAD / (its retry loop sits
    # inside its try), and then refuses to serve ("a shareable link must be created"). A loaded
    # 2-core machine can take longer than that to answer the page (it failed once so in the test
    # suite), so that check is off and ours, patient, runs instead; Gradio has by then already
    # fetched its own /startup-events over localhost.
    demo.launch(server_name=server_name, server_port=server_port, share=share, max_file_size=max_file_size,
                app_kwargs=app_kwargs, prevent_thread_lock=True, _frontend=False, **launch_kw)
    if not share:
        wait_until_served(demo.local_url)
    if block:
        demo.block_thread()
    return demo


def wait_until_served(url: str, timeout_s: float = 120.0) -> None:
    """Return once `url` answers a HEAD (any status below 500), retrying refused connections
    and slow answers for up to `timeout_s`; else raise RuntimeError saying what was tried."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            r = httpx.head(url, timeout=min(30.0, max(1.0, deadline - time.monotonic())))
            if r.status_code < 500:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the app at {url} did not answer within {timeout_s:.0f} s ({last}); "
                               "check that nothing blocks connections to this host and port (a proxy, "
                               "a firewall, HTTP_PROXY without NO_PROXY=localhost)")
        time.sleep(0.5)

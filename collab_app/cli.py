"""`collab ...`: one console script, one subcommand per entry point.

Each subcommand lives next to the code it drives and is imported only when used, so
`collab --help` is instant (no torch / vllm import).
"""
from __future__ import annotations

import importlib
import sys

# name -> (module:function taking argv, one-line help)
COMMANDS = {
    "models": ("collab_app.commands.models:cli_main", "provision / show the embedded model (SmolLM2-135M-Instruct) and engines"),
    "bench": ("collab_app.commands.bench:cli_main", "benchmarks: `bench generate` (vLLM vs transformers), `bench train` (MAGRPO step)"),
    "eval": ("collab_app.commands.evaluate:cli_main", "evaluate the team and the baselines on a task split"),
    "train": ("collab_app.commands.train_cmd:cli_main", "offline MAGRPO training on a task's train split"),
    "trainer": ("collab_app.online.service:cli_main", "background trainer service: trains on ready groups from the store"),
    "serve": ("collab_app.web.serve:cli_main", "engine + Gradio app + trainer service"),
    "export": ("collab_app.online.export:cli_main", "export collected groups, samples and rewards (JSONL, datasets, Parquet)"),
    "doctor": ("collab_app.commands.doctor:cli_main", "what this machine gives the app (CPU budget, sandbox, engine per agent) and whether training advances"),
}


SEALED_FIRST = ("trainer",)
"""commands that get their secrets only from the environment (the trainer child: the store URL in
COLLAB_DB): secret_env.seal() runs before their module is imported, so the process is never
dumpable with a secret in its environment (torch's import alone takes seconds). The command
reads them back with secret_env.held()/seal()."""


def _usage() -> str:
    lines = ["usage: collab <command> [options]   (collab <command> --help for details)", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def prepare_process() -> None:
    """This process's CPU settings, made before any command imports torch
    (collab_app/cpu/process.py): every command and the children it starts get them; the sandbox
    counts CPUs within the cgroup's quota."""
    from collab_app import paths
    from collab_app.cpu import cores, process
    from tasks import sandbox

    process.prepare(paths.compile_cache_dir())
    sandbox.set_cpu_budget(cores.cpu_budget)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"collab: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func = COMMANDS[name][0].split(":")
    prepare_process()
    if name in SEALED_FIRST:   # before its module imports torch (or anything that starts threads)
        from collab_app import secret_env
        secret_env.seal()
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

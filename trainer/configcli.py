"""Parse a CLI from a flat config dataclass, so config and CLI never drift apart.

Every field becomes `--field-name`; its help is the field's one-line doc, written as
`field: type = default` followed by a docstring literal in the class body (read from the
source with `ast`, so the doc lives exactly once, next to the field). Booleans take
`--flag / --no-flag`. Validation stays in the dataclass's `__post_init__`; a ValueError there
becomes an argparse error naming the fix.

Lives in trainer/ because collab_app may import trainer but not the other way round.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing


def field_docs(cls) -> dict[str, str]:
    """{field name: the string literal right after it in the class body}, inherited docs included."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    docs.update(_own_field_docs(cls))
    return docs


def _own_field_docs(cls) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for stmt, nxt in zip(body, body[1:] + [None]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) \
                    and isinstance(nxt.value.value, str):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(tp):
    """int | None -> int; Literal["a","b"] -> (str, choices)."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin is typing.Literal:
        return type(args[0]), list(typing.get_args(tp))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return _base_type(args[0])
    return tp, None


def add_dataclass_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        tp, choices = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        help_ = f"{docs.get(f.name, '')} (default: {default!r})"
        flag = "--" + f.name.replace("_", "-")
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_)
        elif typing.get_origin(tp) in (list, tuple):
            item = (typing.get_args(tp) or (str,))[0]
            parser.add_argument(flag, dest=f.name, nargs="+", type=item, default=argparse.SUPPRESS, help=help_)
        else:
            parser.add_argument(flag, dest=f.name, type=tp if tp in (int, float, str) else str,
                                choices=choices, default=argparse.SUPPRESS, help=help_)


def parse_config(cls, argv: list[str] | None, description: str, prog: str | None = None,
                 extra: typing.Callable[[argparse.ArgumentParser], None] | None = None):
    """Parse argv into an instance of dataclass `cls`. Returns (config, other_args_namespace)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if extra:
        extra(parser)
    add_dataclass_args(parser, cls)
    ns = parser.parse_args(argv)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in vars(ns).items() if k in names}
    others = argparse.Namespace(**{k: v for k, v in vars(ns).items() if k not in names})
    try:
        cfg = cls(**kwargs)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    return cfg, others

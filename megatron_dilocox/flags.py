"""Command-line flags generated from config dataclasses: a setting's name, default and help are
stated once, as a dataclass field and the docstring under it.

A field ``local_steps: int = 20`` of a section with prefix ``dilocox`` becomes
``--dilocox-local-steps`` (type from the annotation, default from the field, help from the first
paragraph of its docstring); ``metadata`` may rename the flag (``flag``), restrict its values
(``choices``) or leave its default to be resolved after parsing (``resolved``: the flag defaults
to None). A field without a default is a required flag; ``list[T]`` takes any number of values.
Booleans: off by default -> a switch (``store_true``); on by default -> ``--P-no-NAME``;
``bool | None`` -> ``--P-NAME`` / ``--no-P-NAME``. A section without prefix (``prefix=None``)
has flags ``--NAME`` (``--no-NAME``) and its values under the fields' own names. No torch here:
tools/plan.py builds its parser from the same fields.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from functools import cache

_ROLE = re.compile(r":\w+:`~?(?:[\w.]+\.)?([\w]+)`")


@cache
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (read from its source), by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def help_text(doc: str) -> str:
    """A docstring's first paragraph as one line of plain text (reST roles and literals unwrapped)."""
    first = " ".join(doc.split("\n\n")[0].split())
    return _ROLE.sub(r"\1", first).replace("``", "")


def _name(f: dataclasses.Field) -> str:
    """NAME of a field's flag: ``metadata['flag']``, else the field's name with dashes."""
    return f.metadata.get("flag", f.name.replace("_", "-"))


def flag_name(f: dataclasses.Field, prefix: str | None, negated: bool = False) -> str:
    """``--PREFIX-NAME`` of a field (``--PREFIX-no-NAME`` when ``negated``)."""
    name = ("no-" if negated else "") + _name(f)
    return f"--{prefix}-{name}" if prefix else f"--{name}"


def dest(f: dataclasses.Field, prefix: str | None) -> str:
    """The attribute of the parsed namespace that holds a field's value."""
    return f"{prefix}_{_name(f)}".replace("-", "_") if prefix else f.name


def _value_type(cls, f: dataclasses.Field) -> tuple[type, bool]:
    """A field's type without ``None``, and whether it may be None."""
    hint = typing.get_type_hints(cls)[f.name]
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (value,) = [a for a in args if a is not type(None)]
        return value, True
    return hint, False


def add_flags(group, cls, prefix: str | None, *, names=None, unset: bool = False) -> None:
    """Adds a flag per field of ``cls`` (those in ``names`` if given) to an argparse group.

    ``unset``: every flag defaults to None (a caller that fills in what was not given, such as
    tools/plan.py from a launch's own flags), and its help says nothing about the default.
    """
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        value_type, optional = _value_type(cls, f)
        common = dict(dest=dest(f, prefix), help=help_text(docs[f.name]))
        required = f.default is dataclasses.MISSING and not unset
        default = None if unset or required or f.metadata.get("resolved") else f.default
        if typing.get_origin(value_type) is list:
            (item_type,) = typing.get_args(value_type)
            group.add_argument(flag_name(f, prefix), type=item_type, nargs="*", default=default, **common)
        elif value_type is not bool:
            group.add_argument(flag_name(f, prefix), type=value_type, default=default, required=required,
                               choices=f.metadata.get("choices"), **common)
        elif optional:
            group.add_argument(flag_name(f, prefix), action=argparse.BooleanOptionalAction, default=None, **common)
        elif f.default:
            group.add_argument(flag_name(f, prefix, negated=True), action="store_false", default=default, **common)
        else:
            group.add_argument(flag_name(f, prefix), action="store_true", default=default, **common)


def defaults(cls, prefix: str | None, names=None) -> dict:
    """The field defaults of ``cls`` by namespace attribute (what ``add_flags`` would default to)."""
    return {dest(f, prefix): f.default for f in dataclasses.fields(cls) if names is None or f.name in names}


def from_args(cls, args, prefix: str | None, names=None, **given):
    """An instance of ``cls`` from a parsed namespace (only the fields in ``names`` if given, the
    others at their defaults); ``given`` replaces fields resolved elsewhere."""
    values = {f.name: getattr(args, dest(f, prefix)) for f in dataclasses.fields(cls)
              if f.name not in given and (names is None or f.name in names)}
    return cls(**values, **given)

"""Command-line flags generated from a config dataclass's fields (``EngineConfig``'s).

``add_dataclass_arguments(group, EngineConfig)`` adds one ``--kebab-name`` flag per field,
typed from the field's annotation, with the field's ``help`` and default;
``dataclass_from_args(EngineConfig, args)`` builds the config back from the parsed
values. ``areal-tik generate``, ``check`` and ``serve`` take their engine flags from here,
so an option added to ``EngineConfig`` appears in all three without another edit.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation):
    """(base type, optional, element type of a variadic tuple or None)."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in args if a is not type(None)]
    if typing.get_origin(annotation) is tuple:
        return tuple, optional, typing.get_args(annotation)[0]
    return annotation, optional, None


def _none_or(kind):
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)
    parse.__name__ = kind.__name__
    return parse


def add_dataclass_arguments(parser, cls, defaults: dict | None = None, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of ``cls`` (except ``skip``); ``defaults`` overrides field defaults."""
    defaults = defaults or {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind, optional, item = _base_type(hints[f.name])
        default = defaults.get(f.name, f.default)
        help_text = f.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        elif kind is tuple:
            parser.add_argument(_flag(f.name), type=item, nargs="+", default=default, help=help_text)
        elif kind in (int, float, str):
            parser.add_argument(_flag(f.name), type=_none_or(kind) if optional else kind, default=default,
                                help=help_text + (" ('none' for None)" if optional else ""))
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no command-line form for type {hints[f.name]!r}")


def dataclass_from_args(cls, args: argparse.Namespace, **overrides):
    """``cls`` from the parsed flags of ``add_dataclass_arguments`` (plus ``overrides``)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


def dataclass_to_argv(obj, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that make ``add_dataclass_arguments`` parse back to ``obj``'s values
    (a field at None is left out where its default is None, else written 'none')."""
    argv = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in skip:
            continue
        if value is None:
            if f.default is not None:  # e.g. graph_sample_temperature: default 1.0, None turns it off
                argv += [_flag(f.name), "none"]
            continue
        if isinstance(value, bool):
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, (tuple, list)):
            argv += [_flag(f.name), *(str(v) for v in value)]
        else:
            argv += [_flag(f.name), str(value)]
    return argv

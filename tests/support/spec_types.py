"""The installed ``openai`` and ``anthropic`` packages' request types, walked: the members of a TypedDict union,
the ``type`` literals each member declares, its fields, and Hypothesis strategies that build values of it (so the
spec, not a hand-kept list, says what a request may hold)."""

from __future__ import annotations

import collections.abc as abc
import typing
from typing import Any

import typing_extensions as te
from hypothesis import strategies as st

_MAX_DEPTH = 4
_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=12)


def members(union: Any) -> list[Any]:
    """The TypedDicts a union (or a list of a union) is made of, nested unions flattened."""
    out: list[Any] = []
    for arg in typing.get_args(_unwrap(union)) or (union,):
        arg = _unwrap(arg)
        if te.is_typeddict(arg):
            out.append(arg)
        elif typing.get_origin(arg) in (typing.Union, list, abc.Iterable):
            out += members(arg)
    return out


def type_literals(typed_dict: Any) -> tuple[str, ...]:
    """The values a TypedDict's ``type`` field may take (none when it has no such field)."""
    hint = hints(typed_dict).get("type")
    if hint is None:
        return ()
    return tuple(v for v in literals(hint) if isinstance(v, str))


def union_types(union: Any) -> set[str]:
    return {kind for member in members(union) for kind in type_literals(member)}


def hints(typed_dict: Any) -> dict[str, Any]:
    return typing.get_type_hints(typed_dict, include_extras=True)


def fields(typed_dict: Any) -> set[str]:
    return set(hints(typed_dict))


def of(typed_dict: Any, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Values of a TypedDict: its required fields always, each optional one sometimes (``type`` always)."""
    fields_ = hints(typed_dict)
    required = {name for name, hint in fields_.items() if _is_required(typed_dict, name, hint)}
    always = {name: value(hint, depth + 1) for name, hint in fields_.items() if name in required or name == "type"}
    maybe = {name: value(hint, depth + 1) for name, hint in fields_.items() if name not in always}
    return st.fixed_dictionaries(always, optional=maybe)


def value(hint: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of one annotation, by its shape; past a depth, the smallest values that still fit."""
    hint = _unwrap(hint)
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return st.sampled_from(typing.get_args(hint))
    if origin is typing.Union:
        return st.one_of([value(arg, depth) for arg in typing.get_args(hint)])
    if te.is_typeddict(hint):
        return of(hint, depth) if depth < _MAX_DEPTH else st.builds(dict)
    if origin in (list, abc.Iterable, abc.Sequence) or (origin is not None and _name(origin) == "SequenceNotStr"):
        args = typing.get_args(hint)
        return st.lists(value(args[0], depth + 1), max_size=2 if depth < _MAX_DEPTH else 0) if args else st.just([])
    if origin in (dict, abc.Mapping):
        return st.dictionaries(_text, st.one_of(_text, st.integers()), max_size=2)
    if hint is str:
        return _text
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(min_value=-5, max_value=10_000)
    if hint is float:
        return st.floats(min_value=0, max_value=2, allow_nan=False)
    if hint is type(None):
        return st.none()
    if hint is object:
        return st.one_of(st.none(), _text, st.dictionaries(_text, _text, max_size=2))
    return st.one_of(st.none(), _text)  # anything the walk does not know: a plausible scalar


def _is_required(typed_dict: Any, name: str, hint: Any) -> bool:
    """From the annotation itself: under ``from __future__ import annotations`` a TypedDict's
    ``__required_keys__`` does not see ``Required[...]``."""
    origin = typing.get_origin(hint)
    if origin in (te.Required, typing.Required):
        return True
    if origin in (te.NotRequired, typing.NotRequired):
        return False
    return name in getattr(typed_dict, "__required_keys__", ())


def _unwrap(hint: Any) -> Any:
    while True:
        origin = typing.get_origin(hint)
        if origin in (te.Required, te.NotRequired, te.ReadOnly, typing.Required, typing.NotRequired) \
                or origin is te.Annotated or origin is typing.Annotated:
            hint = typing.get_args(hint)[0]
        elif _name(hint) == "TypeAliasType":
            hint = hint.__value__
        else:
            return hint


def literals(hint: Any) -> list[Any]:
    """The values of the Literals an annotation is made of."""
    hint = _unwrap(hint)
    if typing.get_origin(hint) is typing.Literal:
        return list(typing.get_args(hint))
    return [v for arg in typing.get_args(hint) for v in literals(arg)]


def _name(obj: Any) -> str:
    return getattr(obj, "__name__", "") or type(obj).__name__

"""Turn a pydantic `ValidationError` into kvtier's config message: one line per mistake.

Each line reads `FILE: FIELD.PATH: what was expected, got what`, with list indices written
`tiers[1]` and discriminated-union tags (the `kind`) removed from the path. A misspelt key
comes first (it also makes the field it meant look missing, which is listed after it).
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError


def format_validation_error(err: ValidationError, source: str, root: type[BaseModel]) -> str:
    """Every error of `err`, one line each (the first the likeliest cause)."""
    errors = err.errors(include_url=False)
    # A misspelt key also makes the field it meant "missing": report the typo, the cause,
    # and not the missing fields beside it (the typo's message lists what is expected).
    typo_parents = {e["loc"][:-1] for e in errors if e["type"] == "extra_forbidden"}
    errors = [e for e in errors if not (e["type"] == "missing" and e["loc"][:-1] in typo_parents)]
    errors.sort(key=lambda e: e["type"] != "extra_forbidden")
    lines = []
    for error in errors:
        path, parent = _walk(error["loc"], root)
        field_error = (error.get("ctx") or {}).get("error")
        if getattr(field_error, "path", None):
            path = field_error.path
        line = f"{source}: {path or '(top level)'}: {_message(error, parent)}"
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)


def _walk(loc: tuple[Any, ...], root: type[BaseModel]) -> tuple[str, type[BaseModel] | None]:
    """Render `loc` as a path and return the model class that owns its last element."""
    path = ""
    current: Any = root
    parent: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            current = _list_item(current)
            continue
        tagged = _union_member(current, part)
        if tagged is not None:
            current = tagged
            continue
        model = _as_model(current)
        parent = model
        path += f".{part}" if path else str(part)
        current = _field_type(model, part) if model else None
    return path, parent


def _message(error: dict[str, Any], parent: type[BaseModel] | None) -> str:
    kind = error["type"]
    got = error.get("input")
    if kind == "extra_forbidden":
        known = ", ".join(_aliases(parent)) if parent else ""
        return f"unknown field; expected one of: {known}"
    if kind == "missing":
        return "required field is missing"
    if kind == "union_tag_invalid":
        ctx = error["ctx"]
        return f"unknown kind {ctx['tag']!r}; expected one of: {ctx['expected_tags']}"
    if kind == "union_tag_not_found":
        return "a 'kind' field is required"
    text = error["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if text.startswith(prefix):
            text = text[len(prefix):]
    if kind == "value_error":
        return text
    if kind == "path_type":
        return f"expected a file path, got {_short(got)}"
    return f"{text[0].lower()}{text[1:]}, got {_short(got)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _aliases(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()
            if not f.exclude]


def _strip_annotated(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _union_args(tp: Any) -> tuple[Any, ...]:
    tp = _strip_annotated(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(_strip_annotated(a) for a in typing.get_args(tp))
    return ()


def _as_model(tp: Any) -> type[BaseModel] | None:
    tp = _strip_annotated(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    models = [a for a in _union_args(tp) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 else None


def _union_member(tp: Any, tag: Any) -> type[BaseModel] | None:
    """The member of a discriminated union whose `kind` literal is `tag`, if any."""
    for arg in _union_args(tp):
        for member in _union_args(arg) or (arg,):
            if isinstance(member, type) and issubclass(member, BaseModel):
                kind = member.model_fields.get("kind")
                if kind is not None and tag in typing.get_args(kind.annotation):
                    return member
    return None


def _list_item(tp: Any) -> Any:
    tp = _strip_annotated(tp)
    args = typing.get_args(tp)
    return args[0] if typing.get_origin(tp) is list and args else None


def _field_type(model: type[BaseModel], name: str) -> Any:
    for field_name, field in model.model_fields.items():
        if name in (field_name, field.alias):
            return field.annotation
    return None

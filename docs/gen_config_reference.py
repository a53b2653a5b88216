"""Generates docs/reference/configuration.md from the pydantic models of common/config.py.

    .venv/bin/python docs/gen_config_reference.py

walks ``ServeConfig``'s fields recursively (every nested model: ``http``, ``tenants[]``, ``tenants[].cache``, ...)
and writes, for every field, its dotted path, type, default, constraints and description (``Field(description=...)``),
with each model's docstring as its section's intro. tests/e2e/test_docs.py checks that the committed page equals what
this renders, and that every field has a description.
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: common/ is importable
    sys.path.insert(0, str(ROOT))

from common.config import ServeConfig, parse_duration  # noqa: E402

OUTPUT = ROOT / "docs" / "reference" / "configuration.md"
COMMAND = ".venv/bin/python docs/gen_config_reference.py"


@dataclass(frozen=True)
class Section:
    """One model where it sits in the config: ``path`` "" for the top level, else e.g. ``tenants[].cache``."""

    path: str
    model: type[BaseModel]

    @property
    def title(self) -> str:
        return f"Top level: {self.model.__name__}" if not self.path else f"`{self.path}`: {self.model.__name__}"

    @property
    def anchor(self) -> str:
        """The heading's anchor, the same on the MkDocs site (Python-Markdown's toc) and on GitHub."""
        return slug(self.title)


@dataclass(frozen=True)
class Entry:
    """One field: ``path`` is its dotted path (``http.port``, ``tenants[].cache.mode``)."""

    path: str
    name: str
    section: Section
    info: FieldInfo


def slug(title: str) -> str:
    """A heading's anchor: lowercase, only letters, digits, ``_``, ``-`` and spaces kept, spaces as ``-``. The titles
    here have no runs of spaces or hyphens, where GitHub's rule and Python-Markdown's would differ."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in "_- ")
    return kept.strip().replace(" ", "-")


def _nested(annotation: object, suffix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """The models in a field's type, each with what follows the field's name in its path (``[]`` in a list)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield suffix, annotation
        return
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        yield from _nested(args[0], suffix)
    elif origin in (list, tuple, set, frozenset):
        for arg in args:
            yield from _nested(arg, suffix + "[]")
    elif origin is dict:
        yield from _nested(args[1], suffix + ".<name>")
    else:
        for arg in args:
            yield from _nested(arg, suffix)


def sections(model: type[BaseModel] = ServeConfig, path: str = "") -> Iterator[Section]:
    """Every model reachable from ``model``, depth first, in the order of the fields."""
    yield Section(path, model)
    for name, info in model.model_fields.items():
        for suffix, sub in _nested(info.annotation):
            yield from sections(sub, f"{path}.{name}{suffix}".lstrip("."))


def entries() -> Iterator[Entry]:
    """Every field of every model reachable from ``ServeConfig``."""
    for section in sections():
        for name, info in section.model.model_fields.items():
            yield Entry(f"{section.path}.{name}".lstrip("."), name, section, info)


def type_text(annotation: object) -> str:
    """A readable type: ``int``, ``"implicit" | "explicit"``, ``list[str]``, ``int | null``, ``CacheConfig``."""
    if annotation is None or annotation is type(None):
        return "null"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join("null" if a is None else json.dumps(a) for a in args)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]" if args else name
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def value_text(value: object) -> str:
    """A value as YAML writes it, with sizes in MiB/GiB beside whole numbers of them."""
    if isinstance(value, BaseModel):
        # A nested model's default: every one of its own fields at their defaults.
        return "`{}`" if value == type(value)() else f"`{json.dumps(value.model_dump(mode='json'))}`"
    if value is None or isinstance(value, (bool, str, list, dict, tuple)):
        return f"`{json.dumps(value)}`"
    text = f"`{value!r}`"
    if isinstance(value, int) and value >= 2**20:
        for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
            if value % size == 0:
                return f"{text} ({value // size} {unit})"
    return text


def default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return value_text(info.default_factory())  # type: ignore[call-arg]
    if info.default is PydanticUndefined:
        return "required"
    return value_text(info.default)


def constraints_text(info: FieldInfo, annotation: object) -> list[str]:
    """``ge``/``gt``/``le``/``lt``/``multiple_of``/``min_length``/``max_length``, ``allow_inf_nan=False`` and
    ``strict``, from the field's metadata."""
    items = "characters" if annotation is str or type_text(annotation) in ("str", "str | null") else "items"
    out: list[str] = []
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            out.append(f"`>= {m.ge!r}`")
        elif isinstance(m, annotated_types.Gt):
            out.append(f"`> {m.gt!r}`")
        elif isinstance(m, annotated_types.Le):
            out.append(f"`<= {m.le!r}`")
        elif isinstance(m, annotated_types.Lt):
            out.append(f"`< {m.lt!r}`")
        elif isinstance(m, annotated_types.MultipleOf):
            out.append(f"a multiple of `{m.multiple_of!r}`")
        elif isinstance(m, annotated_types.MinLen):
            out.append(f"at least {m.min_length} {items[:-1] if m.min_length == 1 else items}")
        elif isinstance(m, annotated_types.MaxLen):
            out.append(f"at most {m.max_length} {items[:-1] if m.max_length == 1 else items}")
        else:
            if getattr(m, "allow_inf_nan", None) is False:
                out.append("finite (no `inf`, `nan`)")
            if getattr(m, "strict", None) is True:
                out.append("strict (no type coercion)")
            if getattr(m, "pattern", None):
                out.append(f"matches `{m.pattern}`")
    return out


def is_duration(model: type[BaseModel], name: str, info: FieldInfo) -> bool:
    """Whether the field takes a duration (``parse_duration``: seconds, or text like ``"5m"``): a ``mode="before"``
    field validator of the model that calls it, or a ``BeforeValidator(parse_duration)`` in the field's type."""
    if any(getattr(m, "func", None) is parse_duration for m in info.metadata):
        return True
    for dec in model.__pydantic_decorators__.field_validators.values():
        func = getattr(dec.func, "__func__", dec.func)
        code = getattr(func, "__code__", None)
        if name in dec.info.fields and dec.info.mode == "before" and code and "parse_duration" in code.co_names:
            return True
    return False


def render() -> str:
    """The whole page."""
    all_sections = list(sections())
    anchors = {s.path: s.anchor for s in all_sections}
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from common/config.py by docs/gen_config_reference.py: do not edit by hand. -->",
        "",
        "Every field of the `kvgrid serve` configuration file (YAML), generated from its pydantic models in",
        "`common/config.py`. A field's path is dotted (`http.port`); `[]` marks a list's items",
        "(`tenants[].cache.mode` is the `cache.mode` of each tenant).",
        "[Configuration](../configuration.md) explains the file as a whole, with examples.",
        "",
    ]
    if all(s.model.model_config.get("extra") == "forbid" for s in all_sections):
        lines += ["Unknown fields are rejected.", ""]
    if all(s.model.model_config.get("strict") for s in all_sections):
        lines += [
            "Types are strict: a value of another type is an error, not converted (`groups: true` and",
            '`min_prefix_tokens: "64"` are rejected), except that an integer is accepted for a float.',
            "",
        ]
    lines += [
        "Sections:",
        "",
    ]
    lines += [f"- [{s.title}](#{s.anchor})" for s in all_sections]
    for section in all_sections:
        lines += ["", f"## {section.title}", ""]
        doc = section.model.__doc__
        if doc:
            lines += [inspect.cleandoc(doc), ""]
        for name, info in section.model.model_fields.items():
            path = f"{section.path}.{name}".lstrip(".")
            lines += [f"### `{path}`", ""]
            kind = f"`{type_text(info.annotation)}`"
            if is_duration(section.model, name, info):
                kind += ' (a positive number of seconds, or a duration like `"90s"`, `"5m"`, `"1h"`)'
            subs = [f"[`{path}{suffix}`](#{anchors[path + suffix]})" for suffix, _ in _nested(info.annotation)]
            if subs:
                kind += f"; its fields: {', '.join(subs)}"
            lines.append(f"- Type: {kind}")
            lines.append(f"- Default: {default_text(info)}")
            constraints = constraints_text(info, info.annotation)
            if constraints:
                lines.append(f"- Constraints: {', '.join(constraints)}")
            lines.append("")
            description = (info.description or "").strip()
            if description and description[-1] not in ".!?:":
                description += "."  # the descriptions are phrases (also CLI help, schema); the page has sentences
            lines += [inspect.cleandoc(description) if description else "*No description yet.*", ""]
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main() -> None:
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

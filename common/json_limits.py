"""Limits on the JSON a request carries, checked before any of it is rendered, compiled or sent to a worker group, so
that a hostile value is a ``ValueError`` naming its field (a 400) instead of a ``RecursionError`` in the chat
template or an error of the grammar engine in the middle of a step.

- Nesting: any JSON value of a request (tool-call arguments, tool inputs, schemas) nests at most
  ``MAX_JSON_DEPTH`` levels; ``loads`` reads JSON text (arguments are JSON in a string) with that limit, whatever
  the text's own depth (Python's parser raises ``RecursionError`` past about a thousand).
- JSON schemas (``response_format``, a forced tool's parameters): at most ``MAX_SCHEMA_NODES`` values;
  ``pattern`` regexes (and ``patternProperties`` names) whose counted repetitions expand past
  ``MAX_PATTERN_EXPANSION`` items are refused (``(a{1000}){1000}`` is a million: the grammar engine's lexer gives
  up on it, after a second of a worker's step); and a ``$ref`` that has no finite value (it recurses without an
  exit: a required property, or the items of a non-empty array, that refer back to it) is refused by name, since
  the grammar engine runs out of parser items as soon as it gets there. Recursion with an exit (an optional
  property, an ``anyOf`` branch, an array that may be empty) is supported: the engine bounds it per step itself.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_JSON_DEPTH = 64  # levels of arrays and objects in one value
MAX_SCHEMA_NODES = 10_000  # every value in a schema: objects, arrays, strings, numbers
MAX_PATTERN_EXPANSION = 10_000  # items a pattern's counted repetitions expand to: (a{100}){100} is 10000
_MAX_REF_WORK = 200_000  # schema nodes visited while checking its $refs (an adversarial schema is refused)

_COUNTED = re.compile(r"\{(\d*)(,?)(\d*)\}")
_CAP = 1 << 62  # sizes stop growing here (a pattern of many nested counts must not make huge integers)


def depth_error(field: str, limit: int = MAX_JSON_DEPTH) -> ValueError:
    return ValueError(f"{field}: nested deeper than {limit} levels")


def check_depth(value: Any, field: str, limit: int = MAX_JSON_DEPTH) -> int:
    """Raise ``ValueError`` naming ``field`` when ``value`` nests more than ``limit`` arrays and objects; return
    how many values it holds (itself included). Iterative: any depth is safe to check."""
    stack, count = [(value, 0)], 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= limit and children:
            raise depth_error(field, limit)
        stack.extend((c, depth + 1) for c in children)
    return count


def loads(text: str, field: str, limit: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)``, nesting at most ``limit`` levels (``ValueError`` naming ``field`` beyond, and for text
    that is not JSON, as ``json.loads`` raises it)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise depth_error(field, limit) from None
    check_depth(value, field, limit)
    return value


# -- regexes ----------------------------------------------------------------------------------------------------


def pattern_expansion(pattern: str) -> int:
    """How many items ``pattern``'s counted repetitions expand to, roughly as a lexer builds them: a sequence is
    the sum of its items, an alternation the sum of its branches, ``x{n}`` / ``x{n,m}`` / ``x{n,}`` the size of
    ``x`` times ``n`` / ``m`` / ``n + 1``; ``*``, ``+`` and ``?`` do not multiply. Lenient: what is not a regex
    construct counts as one item each (the grammar engine reports real syntax errors itself)."""
    stack: list[tuple[int, int]] = []  # per open group: (size of its finished branches, size of the current one)
    branches, current = 0, 0  # the top level
    last = 0  # size of the last item of the current branch (what a quantifier applies to)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            j = i + 2
            if i + 2 < n and pattern[i + 1] in "pPxuk" and pattern[i + 2] == "{":  # \p{L}, \x{41}, \k{name}
                end = pattern.find("}", i + 2)
                j = n if end < 0 else end + 1
            last = 1
            current += 1
            i = j
            continue
        if c == "[":  # a class: one item (its ']' may come first: []a] and [^]a] hold a ']')
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            last = 1
            current += 1
            i = j + 1
            continue
        if c == "(":
            stack.append((branches, current))
            branches, current = 0, 0
            i += 1
            continue
        if c == ")" and stack:
            size = branches + current
            branches, current = stack.pop()
            last = min(_CAP, max(1, size))
            current = min(_CAP, current + last)
            i += 1
            continue
        if c == "|":
            branches += current
            current = last = 0
            i += 1
            continue
        if c == "{":
            m = _COUNTED.match(pattern, i)
            if m is not None and (m.group(1) or m.group(3)):
                low = _count(m.group(1))
                high = _count(m.group(3)) if m.group(3) else (low + 1 if m.group(2) else low)
                times = max(low, high, 1)
                current = min(_CAP, current + last * (times - 1))  # the item is there once already
                last = min(_CAP, last * times)
                i = m.end()
                continue
        if c in "*+?":
            i += 1
            continue
        last = 1
        current += 1
        i += 1
    while stack:  # unclosed groups: sum them up anyway
        size = branches + current
        branches, current = stack.pop()
        current += size
    return branches + current


def _count(digits: str) -> int:
    return int(digits or 0) if len(digits) <= 18 else _CAP  # (no 4300-digit int() either)


def check_pattern(pattern: str, field: str) -> None:
    size = pattern_expansion(pattern)
    if size > MAX_PATTERN_EXPANSION:
        raise ValueError(
            f"{field}: the pattern {_short(pattern)} expands to {size} items through its counted repetitions "
            f"(at most {MAX_PATTERN_EXPANSION}: bound nested {{n}} repetitions, or use maxLength)"
        )


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


# -- schemas ----------------------------------------------------------------------------------------------------


def _pointer(root: Any, ref: str) -> Any:
    """The node a local ``$ref`` (``#``, ``#/$defs/a``) points at in ``root``; None when it points nowhere (or is not
    local: the grammar engine reports those itself)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _Refs:
    """Which of a schema's ``$ref`` targets have a finite value: the least fixed point of "has a finite instance",
    found with a work list (a target is evaluated again only when a ref it read turned out finite)."""

    def __init__(self, root: Any, field: str) -> None:
        self.root, self.field = root, field
        self.finite: dict[str, bool] = {}
        self.work = 0
        self._read: set[str] = set()

    def ok(self, node: Any) -> bool:
        """Whether ``node`` may have a finite instance, taking the refs as ``finite`` says (unknown: False)."""
        self.work += 1
        if self.work > _MAX_REF_WORK:
            raise ValueError(f"{self.field}: the schema's $refs are too intricate to check (simplify it)")
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            return True  # not a schema: the grammar engine says what is wrong with it
        ref = node.get("$ref")
        if isinstance(ref, str) and _pointer(self.root, ref) is not None:
            self._read.add(ref)
            if not self.finite.get(ref, False):
                return False
        for sub in _list(node.get("allOf")):
            if not self.ok(sub):
                return False
        for key in ("anyOf", "oneOf"):
            subs = _list(node.get(key))
            if subs and not any(self.ok(sub) for sub in subs):
                return False
        if "const" in node or "enum" in node:
            return True
        types = node.get("type")
        if types is None:
            return True  # any type: a string will do
        return any(self._type_ok(node, t) for t in (types if isinstance(types, list) else [types]))

    def _type_ok(self, node: dict, kind: Any) -> bool:
        if kind == "object":
            props = node.get("properties")
            props = props if isinstance(props, dict) else {}
            rest = node.get("additionalProperties", True)
            return all(self.ok(props.get(name, rest)) for name in _list(node.get("required")) if isinstance(name, str))
        if kind == "array":
            low = node.get("minItems", 0)
            low = low if isinstance(low, int) else 0
            items = node.get("items", True)
            prefix = _list(node.get("prefixItems")) or (items if isinstance(items, list) else [])
            rest = node.get("additionalItems", True) if isinstance(items, list) else items
            return all(self.ok(s) for s in prefix[:low]) and (low <= len(prefix) or self.ok(rest))
        return True

    def check(self, refs: set[str]) -> None:
        targets = {r: _pointer(self.root, r) for r in refs}
        targets = {r: t for r, t in targets.items() if t is not None}
        readers: dict[str, set[str]] = {}
        todo = list(targets)
        while todo:
            ref = todo.pop()
            if self.finite.get(ref):
                continue
            self._read = set()
            if self.ok(targets[ref]):
                self.finite[ref] = True
                todo.extend(readers.get(ref, ()))
            for read in self._read:
                readers.setdefault(read, set()).add(ref)
        for ref in sorted(targets):
            if not self.finite.get(ref):
                raise ValueError(
                    f"{self.field}: $ref {ref!r} has no finite value: it recurses without an exit (make the "
                    "recursive property optional, allow an empty array, or add a non-recursive anyOf branch)"
                )


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def check_schema(schema: Any, field: str) -> None:
    """Raise ``ValueError`` naming ``field`` for a JSON schema over the limits above: its nesting, its size, a
    ``pattern`` that expands too far, a ``$ref`` without a finite value."""
    nodes = check_depth(schema, field)
    if nodes > MAX_SCHEMA_NODES:
        raise ValueError(f"{field}: the schema has {nodes} values; at most {MAX_SCHEMA_NODES} are supported")
    refs: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                check_pattern(value, field)
            elif key == "patternProperties" and isinstance(value, dict):
                for regex in value:
                    check_pattern(regex, field)
            elif key == "$ref" and isinstance(value, str):
                refs.add(value)
            stack.append(value)
    if refs:
        _Refs(schema, field).check(refs)

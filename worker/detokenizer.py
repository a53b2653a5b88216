"""Incremental detokenizing: a request's output text, decoded a few tokens at a time, equal to decoding all of its
tokens at once. A step decodes only the tokens since the last point where the text was known to be final, never the
whole output again. Imports nothing of the engine: a ``Sequence`` holds one.
"""

from __future__ import annotations

from collections.abc import Callable

_REPLACEMENT = "\ufffd"  # what decoding makes of an incomplete UTF-8 sequence


def stable_len(text: str) -> int:
    """Length of ``text`` without a trailing incomplete UTF-8 character (decoded as U+FFFD), which the next
    token may still complete into something else."""
    n = len(text)
    while n and text[n - 1] == _REPLACEMENT:
        n -= 1
    return n


class IncrementalDetokenizer:
    """One request's output text, decoded a window at a time, equal to decoding all its tokens at once.

    ``committed`` is the text of ``ids[:read_offset]``. A step decodes the window ``ids[prefix_offset:]``, where
    ``ids[prefix_offset:read_offset]`` are the tokens committed last time: decoding them again gives decoders
    that treat a window's first token specially (a stripped leading space) the same context a full decode has,
    and the new text is what the window adds beyond their text. The window is committed only when its text does
    not end in U+FFFD: the bytes so far then end on a character boundary, so no later token can change them.
    """

    __slots__ = ("committed", "prefix_offset", "read_offset", "_prefix_len")

    def __init__(self) -> None:
        self.committed = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self._prefix_len: int | None = 0  # len(decode(ids[prefix_offset:read_offset])); None: not decoded yet

    def update(self, ids: list[int], decode: Callable[[list[int]], str], start: int = 0) -> str:
        """The whole text of ``ids[start:]`` (every output token so far; earlier calls saw a prefix of them).
        ``start`` lets a caller pass a sequence's prompt and output tokens as they are: slicing off the prompt
        would copy the whole output every step, where only the window is needed."""
        window = decode(ids[start + self.prefix_offset :])
        if self._prefix_len is None:
            self._prefix_len = len(decode(ids[start + self.prefix_offset : start + self.read_offset]))
        new = window[self._prefix_len :]
        if new and not window.endswith(_REPLACEMENT):
            self.committed += new
            self.prefix_offset, self.read_offset, self._prefix_len = self.read_offset, len(ids) - start, None
            return self.committed
        return self.committed + new  # not final yet: shown in ``text``, decoded again next step


def decoder(tokenizer) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, through the Rust tokenizer directly when that is all
    the Python wrapper would do (it adds a few microseconds of argument conversion per call)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)

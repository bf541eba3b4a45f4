"""Streaming token ids so that no response ends inside a character.

Byte-level tokenizers split a multi-byte UTF-8 character over several tokens. The ensemble's
postprocessing model decodes every streamed response on its own, so a response that ends after the
first byte of a character would reach the client as U+FFFD. The sender holds back such trailing
tokens (at most a character's worth) until the character is complete.

The llmapi layout's responses carry all of the text so far; ``IncrementalText`` builds it a short
window of ids per response instead of decoding every id again.
"""

from __future__ import annotations

import json
from typing import Any, Callable

REPLACEMENT = "\ufffd"
MAX_HOLD = 4  # a UTF-8 character has at most 4 bytes, so at most 4 byte tokens
_WINDOW = 2 * MAX_HOLD  # context decoded to look at the end of the text


def held_back(decode: Callable[[list[int]], str], ids: list[int]) -> int:
    """How many trailing ``ids`` to hold back: the shortest tail (≤ MAX_HOLD tokens) whose removal
    leaves text that does not end in an unfinished character, or 0. Text that ends in U+FFFD for any
    other reason (the model produced invalid bytes, or the character itself) is sent whole once no
    short tail explains it. Decodes only the last ``_WINDOW`` ids."""
    tail = ids[-_WINDOW:]
    if not tail or not decode(tail).endswith(REPLACEMENT):
        return 0
    for k in range(1, min(MAX_HOLD, len(tail)) + 1):
        if not decode(tail[:-k]).endswith(REPLACEMENT):
            return k
    return 0


def split_at_character(decode: Callable[[list[int]], str], ids: list[int]) -> tuple[list[int], list[int]]:
    """Split ``ids`` into (send, hold), ``hold`` being the ``held_back`` tail."""
    k = held_back(decode, ids)
    return (list(ids[:-k]), list(ids[-k:])) if k else (list(ids), [])


class IncrementalText:
    """The text of a growing list of token ids, decoding only what each update adds.

    ``update(ids, final)`` returns ``decode(send)`` where ``send`` is all of ``ids`` when ``final``,
    else what ``split_at_character`` would send: the text so far, never ending inside a character
    while more may come. Decoding all of the ids on every update costs O(n) per update, O(n^2) over a
    stream (a 2,048-token reply decoded 2,048 times). Here each update decodes a short window: the
    ids from the previous boundary but one (``_prefix``) up to the previous boundary (``_read``), and
    from ``_prefix`` to the new end. The new text is the second string past the first; the window's
    leading ids give a decoder that treats a word's first piece specially (a leading space dropped at
    the start of the text) the same context both times. Where the two do not agree on their common
    part, or the window may start inside a character, the whole is decoded once and the next window
    starts as usual. UTF-8 resynchronizes at every byte that begins a character, so a window that
    starts at one decodes as the same bytes do within the whole.

    The result equals the full decode for decoders that decode a list as the concatenation of its
    parts' texts, up to a leading-space strip at the start (byte-level BPE; SentencePiece-style
    Metaspace/ByteFallback/Fuse/Strip), which ``tests/test_textstream.py`` checks update by update;
    ``windows_decode_exactly`` tells them from other decoders, for which ``windowed=False`` decodes
    everything on every update."""

    def __init__(self, decode: Callable[[list[int]], str], windowed: bool = True):
        self.decode = decode
        self.windowed = windowed
        self.text = ""
        self._prefix = 0  # the window decoded for context starts here
        self._read = 0  # self.text is decode(ids[:self._read])

    def update(self, ids: list[int], final: bool = False) -> str:
        end = len(ids) - (0 if final else held_back(self.decode, ids))  # no copy of the ids per update
        if end < self._read:  # fewer ids than last time: not a continuation of the same list
            self.text, self._prefix, self._read = "", 0, 0
        if end == self._read:
            return self.text
        if not self.windowed:
            self.text, self._read = self.decode(ids[:end]), end
            return self.text
        prefix = self._prefix
        before = self.decode(ids[prefix:self._read]) if self._read > prefix else ""
        # A window whose leading ids show nothing (a lone word-start mark the decode drops, skipped
        # special tokens) would let its first visible piece count as the start of the text: it starts
        # earlier then, by up to _WINDOW ids, and decodes the whole text if that does not help.
        while not before and 0 < prefix and self._prefix - prefix < _WINDOW:
            prefix -= 1
            before = self.decode(ids[prefix:self._read])
        after = self.decode(ids[prefix:end])
        # A window that starts inside a character (its first bytes decode to U+FFFD: the ids before
        # it were invalid bytes sent whole, which later ids may still complete) is not trusted either.
        if (before or prefix == 0) and not before.startswith(REPLACEMENT) and after.startswith(before):
            self.text += after[len(before):]
        else:
            self.text = self.decode(ids[:end])
        self._prefix, self._read = self._read, end
        return self.text


# Decoders that turn a list of tokens into the concatenation of their texts, apart from a leading
# space dropped at the start (Metaspace; Strip after Fuse, which windows_decode_exactly checks).
_CONCATENATING = {"ByteLevel", "ByteFallback", "Fuse", "Replace", "Metaspace", "Strip"}


def windows_decode_exactly(tokenizer: Any) -> bool:
    """Whether ``IncrementalText``'s windows give a ``tokenizers.Tokenizer``'s full decode: its decoder
    (none, one, or a sequence) is made of ``_CONCATENATING`` parts, a Strip removes leading
    characters only and comes after a Fuse (so it strips the text, not every token)."""
    try:
        dec = json.loads(tokenizer.to_str()).get("decoder")
    except (AttributeError, ValueError):
        return False
    if dec is None:
        return True
    parts = dec.get("decoders", []) if dec.get("type") == "Sequence" else [dec]
    fused = False
    for part in parts:
        kind = part.get("type")
        if kind not in _CONCATENATING:
            return False
        if kind == "Fuse":
            fused = True
        if kind == "Strip" and (part.get("stop", 0) or not fused):
            return False
    return True


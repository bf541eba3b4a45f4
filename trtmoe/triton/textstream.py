"""Streaming token ids so that no response ends inside a character.

Byte-level tokenizers split a multi-byte UTF-8 character over several tokens. The ensemble's
postprocessing model decodes every streamed response on its own, so a response that ends after the
first byte of a character would reach the client as U+FFFD. The sender holds back such trailing
tokens (at most a character's worth) until the character is complete.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"
MAX_HOLD = 4  # a UTF-8 character has at most 4 bytes, so at most 4 byte tokens
_WINDOW = 2 * MAX_HOLD  # context decoded to look at the end of the text


def split_at_character(decode: Callable[[list[int]], str], ids: list[int]) -> tuple[list[int], list[int]]:
    """Split ``ids`` into (send, hold): ``hold`` is the shortest tail (≤ MAX_HOLD tokens) whose
    removal leaves text that does not end in an unfinished character. Text that ends in U+FFFD for
    any other reason (the model produced invalid bytes, or the character itself) is sent whole
    once no short tail explains it."""
    tail = ids[-_WINDOW:]
    if not tail or not decode(tail).endswith(REPLACEMENT):
        return list(ids), []
    for k in range(1, min(MAX_HOLD, len(tail)) + 1):
        if not decode(tail[:-k]).endswith(REPLACEMENT):
            return list(ids[:-k]), list(ids[-k:])
    return list(ids), []

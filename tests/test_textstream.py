"""Streamed token ids are split on character boundaries, so per-response decoding is exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtmoe.triton.textstream import MAX_HOLD, split_at_character

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "trained_mixtral"


@pytest.fixture(scope="module")
def decode():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(FIXTURE))
    return tok, (lambda ids: tok.decode(ids, skip_special_tokens=True))


def _stream(decode, ids, chunk=1):
    """Feed ids ``chunk`` at a time as the sender does; decode every response alone."""
    pieces, held = [], []
    for i in range(0, len(ids), chunk):
        send, held = split_at_character(decode, held + ids[i:i + chunk])
        if send:
            pieces.append(decode(send))
    pieces.append(decode(held))  # the final response carries what is left
    return pieces


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_multibyte_characters_are_never_split(decode, chunk):
    tok, dec = decode
    text = "naïve café — 日本語 🙂 ok “quoted”"
    ids = tok.encode(text, add_special_tokens=False)
    # The fixture's byte-level vocabulary splits these characters over several tokens.
    assert any("\ufffd" in dec([i]) for i in ids)
    pieces = _stream(dec, ids, chunk)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_ascii_is_sent_at_once_and_invalid_bytes_are_not_held_forever(decode):
    tok, dec = decode
    ids = tok.encode("def main():", add_special_tokens=False)
    assert split_at_character(dec, ids) == (ids, [])
    lone = tok.encode("é", add_special_tokens=False)[1:]  # a continuation byte with no lead byte
    junk = lone * (MAX_HOLD + 2)
    send, held = split_at_character(dec, junk)
    assert send == junk and held == []

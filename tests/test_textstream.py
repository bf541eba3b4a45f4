"""Streamed token ids are split on character boundaries, so per-response decoding is exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtmoe.triton.textstream import MAX_HOLD, split_at_character

TRIALS = 60
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


def _sentencepiece_style(kind: str):
    """A small Llama/Mistral-style tokenizer: '▁' marks word starts, bytes fall back to <0xNN> tokens,
    and decoding drops the leading space of the text (``kind``: the Replace/ByteFallback/Fuse/Strip
    sequence of Llama 2 and Mixtral, or the Metaspace decoder of newer conversions)."""
    import inspect
    import json as json_module

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    if kind == "sequence":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    text = inspect.getsource(json_module).splitlines() + ["naïve café — 日本語 🙂 “quoted”"] * 5
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=600, special_tokens=special))
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


@pytest.fixture(scope="module", params=["byte_level", "sequence", "metaspace"])
def tokenizer(request):
    from tokenizers import Tokenizer

    if request.param == "byte_level":
        return Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    return _sentencepiece_style(request.param)


def test_incremental_text_equals_the_full_decode_at_every_update(tokenizer):
    import random

    from trtmoe.triton.textstream import IncrementalText, windows_decode_exactly

    assert windows_decode_exactly(tokenizer)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(0)
    V = tokenizer.get_vocab_size()
    specials = [tokenizer.token_to_id(t) for t in ("<s>", "</s>") if tokenizer.token_to_id(t) is not None]
    words = tokenizer.encode("naïve café — 日本語 🙂 “quoted” def main(): return {'a': 1}").ids
    updates = 0
    for trial in range(TRIALS):
        ids: list[int] = []
        inc = IncrementalText(decode)
        for _ in range(rng.randrange(1, 40)):
            pick = rng.random()
            # Random ids (invalid byte runs included), whole words, and special tokens the decode skips.
            ids += ([rng.randrange(V)] if pick < 0.4 else words[rng.randrange(len(words)):][:rng.randrange(1, 4)]
                    if pick < 0.85 else [rng.choice(specials)] * rng.randrange(1, 3) if specials else [0])
            sent, _ = split_at_character(decode, ids)
            assert inc.update(ids) == decode(sent), (trial, ids)
            updates += 1
        assert inc.update(ids, final=True) == decode(ids), (trial, ids)
    assert updates > 1000


def test_incremental_text_decodes_a_window_per_update_not_the_whole_text(tokenizer):
    from trtmoe.triton.textstream import IncrementalText

    ids = tokenizer.encode("naïve café — 日本語 🙂 “quoted”, then plain words " * 60).ids
    decoded = []

    def decode(part):
        decoded.append(len(part))
        return tokenizer.decode(part, skip_special_tokens=True)

    inc = IncrementalText(decode)
    for n in range(1, len(ids) + 1):
        text = inc.update(ids[:n])
    assert text == inc.update(ids, final=True) == tokenizer.decode(ids)
    assert len(ids) > 500
    # Whole-text decoding would read about n^2 / 2 ids; the windows read a few dozen per update.
    assert sum(decoded) < 40 * len(ids) < len(ids) ** 2 / 20


def test_decoders_that_do_not_concatenate_decode_the_whole_text():
    from tokenizers import Tokenizer, decoders, models

    from trtmoe.triton.textstream import IncrementalText, windows_decode_exactly

    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "ab": 1, "##cd": 2, "ef": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    assert not windows_decode_exactly(tok)
    tok.decoder = decoders.Strip(" ", 1, 0)  # per token, without a Fuse before it
    assert not windows_decode_exactly(tok)
    tok.decoder = decoders.WordPiece()
    inc = IncrementalText(tok.decode, windowed=False)
    ids = [1, 2, 3, 2]
    assert [inc.update(ids[:n]) for n in range(1, 5)] == [tok.decode(ids[:n]) for n in range(1, 5)]

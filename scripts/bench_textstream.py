#!/usr/bin/env python3
"""What building a streamed response's cumulative text costs, per response, as a stream grows.

The llmapi layout's ``text_output`` carries all of the text so far. Two ways to build it, measured in
the same run on the same ids (a tokenizer's encoding of Python's own ``json`` sources, repeated):

* ``whole``: decode every generated id again for each response (``decode(split_at_character(ids))``);
* ``windows``: ``trtmoe.triton.textstream.IncrementalText``, which decodes a short window per response.

Both give the same text at every step (checked here too). Prints microseconds per response, averaged
over a stream of N tokens, one response per token (both loops slice the ids the same way).

    python scripts/bench_textstream.py
    python scripts/bench_textstream.py --tokenizer /path/to/tokenizer.json --tokens 64 512 2048 8192
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path,
                    default=REPO_ROOT / "tests" / "fixtures" / "trained_mixtral" / "tokenizer.json")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 2048, 4096])
    args = ap.parse_args()

    from tokenizers import Tokenizer

    from trtmoe.triton.textstream import IncrementalText, split_at_character, windows_decode_exactly

    tok = Tokenizer.from_file(str(args.tokenizer))
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    source = Path(json.__file__).with_name("decoder.py").read_text()
    ids = tok.encode(source).ids
    while len(ids) < max(args.tokens):
        ids += ids
    print(f"tokenizer {args.tokenizer} (windows exact for its decoder: {windows_decode_exactly(tok)})")
    print("| tokens streamed | whole-text decode, us/response | windows, us/response | same text |")
    print("|---|---|---|---|")
    for n in args.tokens:
        stream = ids[:n]
        whole, t = [], time.perf_counter()
        for k in range(1, n + 1):
            whole.append(decode(split_at_character(decode, stream[:k])[0]))
        t_whole = (time.perf_counter() - t) / n
        inc = IncrementalText(decode)
        windows, t = [], time.perf_counter()
        for k in range(1, n + 1):
            windows.append(inc.update(stream[:k]))
        t_windows = (time.perf_counter() - t) / n
        print(f"| {n:,} | {t_whole * 1e6:.1f} | {t_windows * 1e6:.1f} | {whole == windows} |")


if __name__ == "__main__":
    main()

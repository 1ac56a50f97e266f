"""Encoding a long text in pieces, with a pause between them, to the same token ids.

A document's tokenization is one call into the Rust tokenizer: 70 ms of a core for 12k tokens of
the default model on an AVX2 host, 300 ms under a flood. Once begun it cannot be stopped, and a
document that arrived a moment before a burst of urgent chat turns held a core through their
first few hundred milliseconds. Encoded in pieces of PIECE_CHARS, the lane that tokenizes it can
stop between two pieces while more urgent work is owed (engine.serving.due_first_outputs), as the
engine stops a forward pass between two layers.

The pieces' token ids, joined, must be the text's: a token never spans a seam. A seam is put at a
single space between a letter or digit and a letter ("word| word"), where byte-level BPE's
pre-tokenizers (GPT-2's, Llama 3's, Qwen's) and SentencePiece's metaspace split the text anyway,
the space going with the word after it; and each seam is checked before it is used: the
SEAM_WINDOW_CHARS either side of it, encoded whole, must equal the two sides encoded apart. A
tokenizer that treats the start of a text specially (a normalizer that prepends "▁" to every
input) fails that check at every seam, and its text is encoded whole. Special tokens are added
once, by the tokenizer's own post-processor, around the joined pieces.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

# About 2k tokens of English: some 10 ms of a core, the longest a lane runs before it can stop.
PIECE_CHARS = 8_192
# Characters of context either side of a seam in its check: several words, more than any added
# token the seam could fall inside.
SEAM_WINDOW_CHARS = 64

# A space after a letter or digit and before a letter.
_SEAM = re.compile(r"(?<=[^\W_]) (?=[^\W\d_])")


def seams(backend: Any, text: str, piece_chars: int = PIECE_CHARS) -> list[int]:
    """The offsets where `text` is cut: about every `piece_chars`, at the first checked seam
    after each such mark; none for a text shorter than two pieces."""
    cuts: list[int] = []
    mark = piece_chars
    while mark + piece_chars // 2 < len(text):
        cut = _checked_seam(backend, text, mark, min(len(text), mark + piece_chars))
        if cut is None:
            break
        cuts.append(cut)
        mark = cut + piece_chars
    return cuts


def _checked_seam(backend: Any, text: str, start: int, end: int) -> int | None:
    """The first seam in text[start:end] whose check passes; None if none does."""
    for match in _SEAM.finditer(text, start, end):
        cut = match.start()
        lo = max(0, cut - SEAM_WINDOW_CHARS)
        window = text[lo:cut + SEAM_WINDOW_CHARS]
        split = cut - lo
        whole = backend.encode(window, add_special_tokens=False).ids
        if whole == (backend.encode(window[:split], add_special_tokens=False).ids
                     + backend.encode(window[split:], add_special_tokens=False).ids):
            return cut
    return None


def encode_in_pieces(backend: Any, text: str, add_special_tokens: bool,
                     between: Callable[[], object], piece_chars: int = PIECE_CHARS
                     ) -> list[int]:
    """`text`'s token ids through the fast tokenizer's `backend` (a `tokenizers.Tokenizer`),
    encoded piece by piece with `between()` called after each piece but the last. Each piece
    is encoded with the GIL released (the batch call), so the process's event loop runs
    beside it."""
    cuts = seams(backend, text, piece_chars)
    if not cuts:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    bounds = [0, *cuts, len(text)]
    pieces = []
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if i:
            between()
        pieces.append(backend.encode_batch([text[lo:hi]], add_special_tokens=False)[0])
    if not add_special_tokens:
        return [token for piece in pieces for token in piece.ids]
    from tokenizers import Encoding

    # The tokenizer's own post-processor adds its special tokens (a BOS, an EOS, a template)
    # around the whole, as its encode would.
    return backend.post_process(Encoding.merge(pieces, growing_offsets=True),
                                add_special_tokens=True).ids

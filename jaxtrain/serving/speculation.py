"""Speculative decoding by n-gram prompt lookup: a sequence's next tokens are guessed from its
own text, and one compiled step checks every guess at once.

The draft: the last n tokens of the sequence (n from `longest` down to `shortest`) are looked
for earlier in its prompt and output; the tokens that followed their latest earlier
occurrence are the guess. Code edits, summaries and answers that quote their question repeat
long spans, and those are the spans it guesses right.

The check is exact, not probabilistic: the step feeds the newest token and its draft of k
tokens, draws a token after each of the k + 1 positions with the request's own sampler (its
seed folded with the position, as every draw of the engine), and keeps the draft's tokens as
long as each equals the token drawn at its position, then the first drawn token that differs.
Each kept token is the one decoding without a draft would have drawn, so greedy and seeded
outputs are token for token those of the engine without speculation; a step gains as many
tokens as the draft got right.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ngram_draft"]


def ngram_draft(tokens: np.ndarray, k: int, *, longest: int = 4, shortest: int = 2) -> np.ndarray:
    """Up to `k` tokens guessed to follow `tokens`: those after the latest earlier occurrence
    of its last n tokens, for the largest n in [shortest, longest] that occurs (none: empty)."""
    size = len(tokens)
    for n in range(min(longest, size - 1), shortest - 1, -1):
        tail = tokens[size - n :]
        # Every window of n tokens that ends before the last token (so something follows it).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: size - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start : start + k]
    return tokens[:0]

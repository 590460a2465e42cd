"""Incremental detokenization and stop-string search for streaming output.

Imports `tokenizers` only; no torch.
"""

from __future__ import annotations

import tokenizers

# Prompt tokens decoded as left context, so tokenizers that drop or merge a leading space see
# the same neighbourhood as a full decode would.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated ids into text deltas with the prefix_offset / read_offset technique.

    Each step decodes only ids[prefix_offset:] and emits what lies past the decode of
    ids[prefix_offset:read_offset]. Text ending in U+FFFD is held back: it is usually a
    multi-byte character split across byte-level tokens that later ids will complete.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids)
        # Region map over self._ids:
        #   [.. prefix_offset)            already emitted, no longer decoded
        #   [prefix_offset, read_offset)  already emitted, decoded again as left context
        #   [read_offset ..)              not yet emitted
        self._prefix_offset = max(len(self._ids) - _PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far, excluding the prompt."""
        return self._text

    def step(self, new_ids: list[int]) -> str:
        """Feed newly generated ids; return the newly stable text (may be "")."""
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (incomplete UTF-8 becomes U+FFFD); call once at finish."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


def find_stop(text: str, stops: tuple[str, ...], search_from: int = 0) -> int | None:
    """Earliest index in `text` where any stop string begins, or None.

    Text before `search_from` was searched already; a match may still straddle that point, so
    the search starts max_len - 1 characters earlier.
    """
    if not stops:
        return None
    start = max(0, search_from - max(len(s) for s in stops) + 1)
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def stop_holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    A streaming server must not emit those characters yet: the next delta may complete a stop.
    """
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best

"""Incremental detokenisation of one sample, and stop-string matching on its text.

Decoding each new token alone breaks multi-byte characters split over
tokens and drops sentencepiece's word-initial spaces, so the text is grown
by decoding a short window of ids twice, with and without the newest tokens
(vLLM's prefix/read offsets): the difference is the new text, held back
while it ends in an incomplete character (U+FFFD).  The window starts in the
prompt's last tokens, so the first generated word keeps its leading space.
Stop strings are searched in the text around each new piece (they may span
tokens); while a sample runs, the last ``len(longest stop) - 1`` characters
are withheld from streaming, since they may begin a stop string.
"""

from __future__ import annotations

# Prompt tokens decoded before the first generated one, as context for spacing.
_CONTEXT = 5


class IncrementalDetokenizer:
    """The text of one sample, grown token by token with ``tokenizer.detokenize``."""

    def __init__(self, tokenizer, prompt: list[int], stop: list[str], include_stop: bool):
        self.decode = tokenizer.detokenize
        self.ids = list(prompt[-_CONTEXT:])
        self.prefix, self.read = 0, len(self.ids)
        self.text = ""
        self.stop, self.include_stop = stop, include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def add(self, token: int, check_stop: bool) -> str | None:
        """Append ``token``; returns the stop string the text now contains (the text cut there), else None."""
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        start = max(0, len(self.text) - self.holdback)
        self.text += after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return self._cut(start) if check_stop else None

    def _cut(self, start: int) -> str | None:
        found = [(self.text.find(s, start), s) for s in self.stop]
        found = [(i, s) for i, s in found if i >= 0]
        if not found:
            return None
        index, stop = min(found)
        self.text = self.text[:index + (len(stop) if self.include_stop else 0)]
        return stop

    def flush(self) -> None:
        """At the end: add whatever is still held back as an incomplete character."""
        if self.read < len(self.ids):
            before = self.decode(self.ids[self.prefix:self.read])
            self.text += self.decode(self.ids[self.prefix:])[len(before):]
            self.prefix = self.read = len(self.ids)

    def stable(self, finished: bool) -> str:
        """The text that can be streamed now (all of it once finished)."""
        return self.text if finished else self.text[:max(0, len(self.text) - self.holdback)]

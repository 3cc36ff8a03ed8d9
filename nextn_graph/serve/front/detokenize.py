"""Incremental detokenizing of one output: ``TextStream`` gives out its text as tokens
arrive, holding back what might still become a stop string or an incomplete character."""

from __future__ import annotations

from ...checkpoint.tokenizer import CheckpointTokenizer


class TextStream:
    """Detokenizes an output as it grows; text that might still become a stop string
    (or an incomplete UTF-8 character) is held back until it cannot.

    Incremental, as vLLM's and TGI's detokenizers: a push decodes only the window of ids
    since the prefix offset, ``ids[prefix:read]`` and ``ids[prefix:]``; the difference is
    the text of ``ids[read:]``. When it does not end in U+FFFD (a character still coming)
    it is final: the offsets move on (prefix to read, read to the end) and the window
    shrinks. The prefix keeps a little context before the new ids, for tokenizers whose
    decode of a piece depends on what precedes it. Special tokens, which decoding leaves
    out anyway, never enter the window (a run of EOS under ignore_eos cannot widen it);
    a window only grows while its text keeps ending in U+FFFD (bytes that are no UTF-8).
    Text and stops are exactly as when the whole output was decoded on every push, for
    byte-level tokenizers (the served one: a piece that starts on a character boundary
    decodes alike whatever precedes it; pending text before its trailing U+FFFD is final)."""

    def __init__(self, tokenizer: CheckpointTokenizer | None, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self._skip = tokenizer.special_ids if tokenizer is not None else frozenset()
        self._window: list[int] = []  # ids[prefix:], special tokens left out
        self._read = 0  # the read offset, in the window
        self._unsent = ""  # final text not given out yet
        self._ahead = 0  # characters of the pending text (of ids[read:]) given out already
        self._parts: list[str] = []  # everything given out
        self.decoded = 0  # ids decoded over all pushes (the work; bounded per push)
        self.stopped = False  # a stop string matched: the text ends before it

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def push(self, tokens: list[int], final: bool) -> str:
        """The new text that is safe to send."""
        if self.tokenizer is None:
            return ""
        self._window.extend(t for t in tokens if t not in self._skip)
        pending = self._pending(final)[self._ahead:]  # (this may move text to _unsent)
        view = self._unsent + pending  # the text not given out yet
        # (an earlier match would have been found: hold covers any stop's length - 1)
        found = [i for i in (view.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            return self._give(view, min(found))
        safe = len(view) if final else len(view) - self.hold
        while not final and safe > 0 and view[safe - 1] == "\ufffd":
            safe -= 1  # maybe the first bytes of a character still coming
        return self._give(view, max(safe, 0))

    def _pending(self, final: bool) -> str:
        """Decode the window; move the offsets on when its new text is final (always on
        the last push). Returns the text that is not final yet."""
        window, read = self._window, self._read
        before = self.tokenizer.decode(window[:read])
        text = self.tokenizer.decode(window)
        self.decoded += read + len(window)
        new = text[len(before):]
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return new
        self._unsent += new[self._ahead:]
        self._ahead = 0
        del window[:read]  # the prefix moves to the read offset,
        self._read = len(window)  # the read offset to the end
        return ""

    def _give(self, view: str, end: int) -> str:
        delta = view[:end]
        taken = min(end, len(self._unsent))
        self._unsent = self._unsent[taken:]
        self._ahead += end - taken  # (only with nothing final left unsent)
        self._parts.append(delta)
        return delta

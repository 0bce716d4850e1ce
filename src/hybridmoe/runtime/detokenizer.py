"""`IncrementalDetokenizer`: streams one request's output text token by token, with stop strings.

Text is decoded over a small sliding window of ids (the vLLM / HF TextStreamer scheme): the delta of a new
token is decode(window + token) minus decode(window). While the decoded window ends in U+FFFD the newest
bytes do not yet form a whole character (byte-level BPE splits emoji and CJK across tokens), so nothing is
emitted until a later token completes it. The window only moves past a clean character boundary, so the
streamed pieces concatenate to exactly decode(all output ids).

Stop strings may span tokens. The detokenizer holds back the longest tail of the text that is still the
start of some stop string; once a stop string appears, the text is cut right before it and `stopped` is set.
With `min_tokens`, stop strings are looked for only from the token after the min_tokens-th on (as vLLM does): a
stop string completed by one of the first min_tokens tokens is ordinary text.

The last few prompt ids are decoded as context, so the first output token gets the spacing it has after
the prompt (sentencepiece-style decoders drop a leading space at the very start of a text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed output ids with `add`; call `flush` once when the request ends for whatever is still held back."""

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = [stop] if isinstance(stop, str) else list(stop or [])
        for stop_string in self._stop:
            if not isinstance(stop_string, str) or not stop_string:
                raise ValueError(f"IncrementalDetokenizer: stop strings must be non-empty str, got {stop_string!r}")

        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []  # the prompt ends mid-character: decode the output on its own
        self._min_tokens, self._num_output_ids = min_tokens, 0
        self._ids: list[int] = context  # prompt context + output ids
        self._prefix_offset = 0  # window start: decode(ids[prefix:read]) is text already accounted for
        self._read_offset = len(context)  # ids before this are in self._text (or are prompt context)
        self._text = ""  # output text decoded so far (cut at the stop string once stopped)
        self._num_emitted_chars = 0  # how much of self._text has been returned
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """The output text so far: everything decoded, held-back tail included, cut before a stop string."""
        return self._text

    def add(self, token_id: int) -> str:
        """Take the next output id; return the newly completed text (possibly ""). After a stop, returns ""."""
        if self.stopped:
            return ""
        self._ids.append(int(token_id))
        self._num_output_ids += 1
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if window_text.endswith(_REPLACEMENT_CHAR):
            return ""  # an incomplete character (or trailing invalid bytes): wait for more ids
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._take_new_text(window_text[len(prefix_text) :], final=False)

    def flush(self) -> str:
        """At the end of the request: decode what is still pending (an unfinished character decodes as
        U+FFFD, as decode(all ids) would) and release the held-back stop-string tail."""
        if self.stopped:
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._take_new_text(window_text[len(prefix_text) :], final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""

    def _take_new_text(self, delta: str, final: bool) -> str:
        self._text += delta
        stop_at, stop_string = self._find_stop()
        if stop_string is not None:
            self._text = self._text[:stop_at]
            self.stopped = True
            self.stop_reason = stop_string
            emit_until = stop_at
        elif final:
            emit_until = len(self._text)
        else:
            emit_until = len(self._text) - self._held_back_length()
        emit_until = max(emit_until, self._num_emitted_chars)
        piece = self._text[self._num_emitted_chars : emit_until]
        self._num_emitted_chars = emit_until
        return piece

    def _find_stop(self) -> tuple[int, str | None]:
        """Earliest stop string in the not-yet-emitted text (emitted text never holds the start of one)."""
        best_at, best_string = len(self._text), None
        if self._num_output_ids <= self._min_tokens:
            return best_at, best_string
        for stop_string in self._stop:
            at = self._text.find(stop_string, self._num_emitted_chars)
            if at != -1 and at < best_at:
                best_at, best_string = at, stop_string
        return best_at, best_string

    def _held_back_length(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        longest = 0
        for stop_string in self._stop:
            for length in range(min(len(stop_string) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop_string[:length]):
                    longest = length
                    break
        return longest

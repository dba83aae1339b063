"""Stop conditions as vLLM 0.32 applies them: stop strings, ``stop_token_ids``, ``min_tokens`` and
``include_stop_str_in_output``. Pure: no I/O.

vLLM splits the work in two, and so does the simulator:

* The engine core (:mod:`engine_simulator.scheduler`, vLLM's ``vllm/v1/core/sched/utils.py``
  ``check_stop``) ends a request on EOS (unless ``ignore_eos``), then on a token of ``stop_token_ids``
  (``stop_reason`` = that id), then on length. Before ``min_tokens`` output tokens, EOS and the stop token
  ids are never sampled (vLLM's ``MinTokensLogitsProcessor`` masks ``all_stop_token_ids``, which holds EOS
  even with ``ignore_eos``): :func:`suppressed_token_ids`.
* The frontend's detokenizer (vLLM's ``vllm/v1/engine/detokenizer.py`` ``BaseIncrementalDetokenizer.update``
  and ``check_stop_strings``; here :class:`OutputText`, run by the core right after sampling so the request
  ends in the same step) builds the output text token by token and looks for stop strings in it:

  - a token that ended the request in the core (EOS or a stop token id) is left out of the text unless
    ``include_stop_str_in_output`` (and EOS, a special token, reads "" with ``skip_special_tokens``);
  - stop strings are only looked for once more than ``min_tokens`` tokens were generated, and only in the
    text after the ``min_tokens``-th token (a match may begin before it and end after);
  - the search covers the new text and the ``len(stop) - 1`` characters before it, so a stop string split
    across tokens is found once, when its last character arrives; when several complete in the new text
    the one that completes first wins, ties going to the list order;
  - on a match the request finishes with ``finish_reason`` "stop" and ``stop_reason`` the stop string
    (whatever the core decided: a stop string found in the text of a request ending on length or EOS wins),
    the text cut before the stop string, or after it with ``include_stop_str_in_output``;
  - streamed deltas hold back ``max(len(stop)) - 1`` characters until the request finishes (none with
    ``include_stop_str_in_output``), so a client never sees the beginning of a stop string that is cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StopParams:
    """The stop fields of a completions or chat request (vLLM 0.32 ``SamplingParams``).

    Attributes:
        stop: stop strings (non-empty, at most 4: validated by the server).
        stop_token_ids: token ids that end the request (``stop_reason`` = the id).
        include_stop_str_in_output: keep the matched stop string (or stop token's text) in the output.
        min_tokens: output tokens before EOS, a stop token id or a stop string can end the request.
        skip_special_tokens: special tokens (EOS) read as "" in the output text (vLLM's default True).
    """

    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True


def suppressed_token_ids(num_output_tokens: int, params: StopParams, eos_token_id: int) -> frozenset[int]:
    """Token ids the sampler may not produce next: EOS and ``stop_token_ids`` while fewer than ``min_tokens``
    tokens were generated (vLLM's ``MinTokensLogitsProcessor`` over ``all_stop_token_ids``), else none."""
    if num_output_tokens >= params.min_tokens:
        return frozenset()
    return params.stop_token_ids | {eos_token_id}


def check_stop_strings(text: str, new_chars: int, stop: Sequence[str], include_in_output: bool) -> tuple[str, int] | None:
    """The stop string that completes first within the last ``new_chars`` characters of ``text``.

    Returns:
        ``(stop string, cut)`` with ``cut`` the length ``text`` keeps (-1: all of it), or None. A match must end
        inside the new characters (it may begin up to ``len(stop) - 1`` characters before them); among several,
        the earliest end wins, ties by the order of ``stop``. ``cut`` is the match's start, or its end with
        ``include_in_output``.
    """
    if new_chars <= 0 or not stop:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        start = text.find(s, max(len(text) - new_chars - len(s) + 1, 0))
        if start != -1 and (best is None or start + len(s) < best[0]):
            best = (start + len(s), start, s)
    if best is None:
        return None
    end, start, s = best
    if not include_in_output:
        return s, start
    return s, -1 if end >= len(text) else end


@dataclass(slots=True)
class OutputText:
    """One request's output text as vLLM's incremental detokenizer builds it, with stop-string matching.

    Args:
        params: the request's stop fields.
        token_text: each token id's own text (the simulator's text is the concatenation of its tokens').
        special_token_ids: ids that read as "" with ``skip_special_tokens``.
    """

    params: StopParams
    token_text: Sequence[str]
    special_token_ids: frozenset[int] = frozenset()
    text: str = ""
    """The output text so far (cut at a matched stop string)."""
    num_tokens: int = 0
    """Output tokens seen (a terminating token left out of :attr:`text` included)."""
    _sent: int = field(default=0, repr=False)

    def _text_of(self, token_id: int) -> str:
        if self.params.skip_special_tokens and token_id in self.special_token_ids:
            return ""
        return self.token_text[token_id]

    def update(self, token_ids: Sequence[int], stop_terminated: bool) -> str | None:
        """Add a step's new tokens; ``stop_terminated``: the core ended the request on the last one (EOS or a
        stop token id). Returns the stop string matched in the text, or None."""
        if not token_ids:
            return None
        params = self.params
        kept = token_ids[:-1] if stop_terminated and not params.include_stop_str_in_output else token_ids
        before = self.num_tokens
        offsets = [len(self.text)]  # text length after each new token (offsets[0]: before them)
        for tid in kept:
            self.text += self._text_of(tid)
            offsets.append(len(self.text))
        self.num_tokens += len(token_ids)
        if len(kept) < len(token_ids):
            offsets.append(len(self.text))
        if not params.stop or self.num_tokens <= params.min_tokens:
            return None
        check_from = offsets[max(params.min_tokens - before, 0)]
        found = check_stop_strings(self.text, len(self.text) - check_from, params.stop,
                                   params.include_stop_str_in_output)
        if found is None:
            return None
        stop, cut = found
        if cut != -1:
            self.text = self.text[:cut]
        return stop

    def delta(self, finished: bool) -> str:
        """The text not handed out yet, less the last ``max(len(stop)) - 1`` characters while unfinished
        (none held with ``include_stop_str_in_output``): vLLM's ``get_next_output_text(finished, delta=True)``."""
        params = self.params
        hold = 0
        if not finished and params.stop and not params.include_stop_str_in_output:
            hold = max(len(s) for s in params.stop) - 1
        end = len(self.text) - hold
        if end <= self._sent:
            return ""
        out = self.text[self._sent:end]
        self._sent = end
        return out

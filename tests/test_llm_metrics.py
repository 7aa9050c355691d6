"""Unit tests of naiad.llm.metrics: vLLM's token metrics on the custom-metrics registry, as /metrics renders them."""

from __future__ import annotations

import re
import types

from naiad.custom_metrics import CustomMetrics
from naiad.llm.metrics import EngineMetrics, token_buckets


def _server():
    return types.SimpleNamespace(custom_metrics=CustomMetrics())


def _value(text: str, name: str, **labels) -> float:
    """The value of the sample `name{labels...}` in Prometheus text (labels matched as a subset)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([^{ ]+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


def test_request_lifecycle_renders_vllm_names():
    server = _server()
    m = EngineMetrics(server, "llama", max_model_len=2048)
    a, b = m.arrived(), m.arrived()
    text = server.custom_metrics.exposition().decode()
    assert "# TYPE vllm:num_requests_waiting gauge" in text
    assert _value(text, "vllm:num_requests_waiting", model_name="llama") == 2
    a.scheduled()
    a.scheduled()  # idempotent
    text = server.custom_metrics.exposition().decode()
    assert _value(text, "vllm:num_requests_waiting", model_name="llama") == 1
    assert _value(text, "vllm:num_requests_running", model_name="llama") == 1
    a.tokens(1)
    a.tokens(3)
    a.finished(7, 4, "stop")
    a.finished(7, 4, "stop")  # idempotent
    b.finished(5, 0, "abort")  # aborted while waiting
    text = server.custom_metrics.exposition().decode()
    assert _value(text, "vllm:num_requests_waiting", model_name="llama") == 0
    assert _value(text, "vllm:num_requests_running", model_name="llama") == 0
    assert _value(text, "vllm:time_to_first_token_seconds_count", model_name="llama") == 1
    assert _value(text, "vllm:inter_token_latency_seconds_count", model_name="llama") == 3
    assert _value(text, "vllm:e2e_request_latency_seconds_count", model_name="llama") == 2
    assert _value(text, "vllm:prompt_tokens_total", model_name="llama") == 12
    assert _value(text, "vllm:generation_tokens_total", model_name="llama") == 4
    assert _value(text, "vllm:request_generation_tokens_sum", model_name="llama") == 4
    assert _value(text, "vllm:request_prompt_tokens_bucket", model_name="llama", le="5") == 1
    assert _value(text, "vllm:request_success_total", model_name="llama", finished_reason="stop") == 1
    assert _value(text, "vllm:request_success_total", model_name="llama", finished_reason="abort") == 1
    assert _value(text, "vllm:request_success_total", model_name="llama", finished_reason="length") == 0
    assert "# TYPE vllm:prompt_tokens_total counter" in text


def test_kv_cache_lora_and_close():
    server = _server()
    m = EngineMetrics(server, "llama")
    m.set_kv_cache_usage(0.25)
    m.set_kv_cache_usage(3.0)  # clamped
    m.set_lora(["a"], [], 4)
    m.set_lora(["a", "b"], ["c"], 4)
    text = server.custom_metrics.exposition().decode()
    assert _value(text, "vllm:kv_cache_usage_perc", model_name="llama") == 1.0
    assert text.count("vllm:lora_requests_info{") == 1  # the old label set is gone
    assert _value(text, "vllm:lora_requests_info", running_lora_adapters="a,b", waiting_lora_adapters="c") > 0
    other = EngineMetrics(server, "other")
    r = m.arrived()
    m.close()
    r.finished(1, 1, "stop")  # after close: nothing raised, nothing recorded
    text = server.custom_metrics.exposition().decode()
    assert 'model_name="llama"' not in text
    assert 'model_name="other"' in text
    other.close()
    assert server.custom_metrics.exposition() == b""


def test_two_instances_share_series_and_close_keeps_the_other():
    server = _server()
    one, two = EngineMetrics(server, "m"), EngineMetrics(server, "m")
    one.arrived().scheduled()
    two.arrived().scheduled()
    text = server.custom_metrics.exposition().decode()
    assert _value(text, "vllm:num_requests_running", model_name="m") == 2
    one.close()  # its running request no longer counts
    text = server.custom_metrics.exposition().decode()
    assert _value(text, "vllm:num_requests_running", model_name="m") == 1


def test_without_a_server_everything_still_works():
    m = EngineMetrics(None, "x")
    r = m.arrived()
    assert m.waiting == 1
    r.scheduled()
    r.tokens()
    r.finished(1, 1, "length")
    m.set_kv_cache_usage(0.5)
    m.set_lora([], [], 1)
    m.close()
    assert (m.waiting, m.running) == (0, 0)


def test_token_buckets_follow_vllm():
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(2048)[-1] == 2000


def test_spec_decode_counters_are_vllms():
    server = _server()
    m = EngineMetrics(server, "llama")
    # before enable_spec_decode (an engine that does not speculate): nothing
    m.spec_decode(1, 4, 4, [1, 1, 1, 1])
    assert "spec_decode" not in server.custom_metrics.exposition().decode()
    m.enable_spec_decode(3)
    m.spec_decode(1, 3, 2, [1, 1])
    m.spec_decode(2, 5, 1, [1])
    text = server.custom_metrics.exposition().decode()
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in text
    assert _value(text, "vllm:spec_decode_num_drafts_total", model_name="llama") == 3
    assert _value(text, "vllm:spec_decode_num_draft_tokens_total", model_name="llama") == 8
    assert _value(text, "vllm:spec_decode_num_accepted_tokens_total", model_name="llama") == 3
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [_value(text, per_pos, model_name="llama", position=str(i)) for i in range(3)] == [2, 1, 0]
    m.close()
    assert "spec_decode" not in server.custom_metrics.exposition().decode()

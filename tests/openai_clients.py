"""The `openai` client pointed at a test server's /v1, and a model's series on the server's /metrics, shared by the
OpenAI API tests."""

from __future__ import annotations

import re

import openai
import requests


def v1_client(server, timeout: float = 60) -> openai.OpenAI:
    """An `openai.OpenAI` client of the server's HTTP port (no retries: a failure shows at once); use it in `with`."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def model_metric(server, name: str, model: str) -> float:
    """The sum of `name`'s samples for `model` (its `model_name` label) on the server's /metrics."""
    text = requests.get(f"http://{server.metrics}/metrics", timeout=10).text
    pattern = re.compile(rf'^{re.escape(name)}\{{[^}}]*model_name="{model}"[^}}]*\}} (\S+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))

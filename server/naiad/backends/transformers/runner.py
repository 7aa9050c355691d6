"""The model runner of a transformers continuous-batching manager, as the per-request hooks (seeds, grammars) need it:
synchronous batching with its batch's requests readable, or a clear 400 naming the feature."""

from __future__ import annotations

import time
from typing import Any

from ...errors import InvalidArgument

INSTALL_TIMEOUT_S = 30.0  # how long a first request that needs a hook waits for the manager's batch processor


def model_runner(manager: Any, feature: str, needs: str) -> Any:
    """The manager's `ModelRunner` once its batch processor exists (it starts with the manager's thread), checked to
    batch synchronously, to expose `inputs_and_outputs.requests_in_batch` and the attribute `needs`;
    InvalidArgument saying `feature` cannot be taken otherwise (transformers' internals: another version or
    asynchronous batching)."""
    deadline = time.monotonic() + INSTALL_TIMEOUT_S
    processor = getattr(manager, "batch_processor", None)
    while processor is None and time.monotonic() < deadline:
        time.sleep(0.01)
        processor = getattr(manager, "batch_processor", None)
    runner = getattr(processor, "model_runner", None)
    ios = getattr(runner, "inputs_and_outputs", None)
    if (
        runner is None
        or getattr(processor, "use_async_batching", False)
        or not hasattr(ios, "requests_in_batch")
        or not getattr(runner, needs, None)
    ):
        raise InvalidArgument(
            f"the transformers backend cannot take {feature} with this transformers version or batching mode"
        )
    return runner

"""Per-request `seed` for the transformers backend: transformers' continuous batching samples every row of a batch
with torch's one global generator, so the rows whose request has a seed are sampled again, each with that request's
own `torch.Generator`, from the same (processed) scores. A seeded request's text then depends on its seed alone,
not on which other requests share its batches.

This hooks `ModelRunner._sample` of the manager's batch processor (transformers' internals: checked when installed,
and seeds are refused with a 400 where the layout is not the one known here, e.g. asynchronous batching).
"""

from __future__ import annotations

import threading
from typing import Any

from .runner import model_runner


class SeededSampling:
    """The seeded requests of one continuous-batching manager and the hook that samples their rows."""

    def __init__(self, manager: Any, device: str):
        import torch

        self.torch = torch
        self.manager = manager
        self.device = device
        self.generators: dict[str, Any] = {}  # request id -> torch.Generator
        self._lock = threading.Lock()
        self._runner: Any = None

    def register(self, request_id: str, seed: int) -> None:
        """Sample `request_id` with a generator of its own seeded with `seed` (call before adding the request)."""
        self._install()
        generator = self.torch.Generator(device=self.device)
        generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        self.generators[request_id] = generator

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _install(self) -> None:
        with self._lock:
            if self._runner is not None:
                return
            runner = model_runner(self.manager, "a per-request 'seed'", "_sample")
            original = runner._sample

            def sample(scores: Any, output_ids: Any) -> None:
                original(scores, output_ids)
                if self.generators:
                    self._resample(runner, scores, output_ids)

            runner._sample = sample
            self._runner = runner

    def _resample(self, runner: Any, scores: Any, output_ids: Any) -> None:
        """Rows are the batch's requests that predict a token, in batch order (as transformers reads them back)."""
        torch = self.torch
        rows = [fs.state.request_id for fs in runner.inputs_and_outputs.requests_in_batch if fs.has_new_token]
        for row, request_id in enumerate(rows[: scores.shape[1]]):
            generator = self.generators.get(request_id)
            if generator is None:
                continue
            probs = torch.nn.functional.softmax(scores[0, row], dim=-1)
            token = torch.multinomial(probs, num_samples=1, generator=generator)
            output_ids[0, row] = token[0]
            if runner.return_logprobs:
                output_ids[1, row] = probs[token[0]].log().view(dtype=torch.int32)

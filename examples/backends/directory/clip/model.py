"""Backend 'clip' in a backend directory, on Naiad's native API: OUTPUT0 = INPUT0 clipped to [lo, hi]."""

import numpy as np

from naiad.backends.api import Backend


class ClipBackend(Backend):
    allow_inline = True  # cheap and synchronous: may run on the event loop once measured fast

    def model_initialize(self, model):
        p = model.parameters
        model.state = (float(p.get("lo", "0")), float(p.get("hi", "1")))

    def instance_execute(self, instance, requests):
        lo, hi = instance.model.state
        batch = instance.gather(requests)
        return instance.scatter(requests, batch, {"OUTPUT0": np.clip(batch.inputs["INPUT0"], lo, hi)})


backend = ClipBackend()

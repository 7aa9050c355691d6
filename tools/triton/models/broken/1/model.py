import triton_python_backend_utils as pb_utils  # noqa: F401


class TritonPythonModel:
    """Always fails to load: initialize() raises."""

    def initialize(self, args):
        raise RuntimeError("broken model: initialize() always fails")

    def execute(self, requests):  # pragma: no cover - never reached
        return []

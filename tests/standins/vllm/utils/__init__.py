"""Stand-in of vllm.utils."""

import uuid


def random_uuid() -> str:
    return uuid.uuid4().hex

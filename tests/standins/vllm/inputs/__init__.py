"""Stand-in of vllm.inputs."""

from vllm.inputs.data import TokensPrompt

__all__ = ["TokensPrompt"]

"""Naiad's Kubernetes operator: InferenceServer pools and InferenceModels loaded into them live."""

__version__ = "0.1.0"

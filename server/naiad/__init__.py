"""Naiad: an inference server that speaks Triton's protocols and serves Triton model repositories."""

__version__ = "0.1.0"

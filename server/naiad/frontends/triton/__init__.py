"""Triton's extensions shared by HTTP and gRPC: reserved request parameters, shared-memory handlers."""

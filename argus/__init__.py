"""Argus: always-on eBPF tracer and performance doctor for large LLM training jobs."""

__version__ = "0.1.0"

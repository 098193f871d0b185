"""Probe targets: one module per library (libcuda, libnccl), each with declarative uprobe specs."""

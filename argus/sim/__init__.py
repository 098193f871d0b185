"""The simulated training job: stand-ins for libcuda.so.1 / libnccl.so.2 and multi-rank trainers.

Modules imported by rank processes (trainer, gpu, build, workload, faults, store) use only
the standard library, so any CPython 3.9+ can run a rank (tests attach to pyenv builds).
"""

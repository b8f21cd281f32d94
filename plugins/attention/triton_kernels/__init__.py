"""Triton kernels of the ``triton`` attention backend: KV write, paged decode
(split-KV), paged prefill. Each module holds one kernel and its launcher."""

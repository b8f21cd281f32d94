"""Tensor parallelism: one model over several processes and devices.

``executor.TensorParallelExecutor`` runs rank 0 in the engine-core and drives the
worker processes (``workers.WorkerPool``, ``worker``); ``group.DistributedGroup`` is
the layers' ``ParallelGroup`` over ``torch.distributed`` (gloo on the CPU, NCCL on
CUDA). The sharding rules are in ``plugins.models.parallel``.
"""

"""``tokenloom sim``: the scheduler lab. Replays a workload through the real scheduler
and KV-cache plugins on the CPU, with the GPU replaced by a calibrated step-time
cost model (``cost_model``), and reports what a scheduler researcher compares."""

"""The executor's sampling: logits of the rows that sample -> token ids on the host.

- ``sampler``: ``Sampler``, the per-request state and one step's batched draw;
- ``sampling_batch``: the per-row parameters of one batch as device tensors;
- ``penalties`` and ``logits_filters``: the processing steps the draw applies;
- ``result``: a draw on the device (``SampleResult``) and the launched step that
  reads it to the host (``PendingSample``).
"""

"""The interfaces of every pluggable component kind, one module per kind.

- ``registry``: ``ComponentSpec`` (one implementation of one kind) and ``KINDS``.
- ``scheduler``: ``Scheduler``, which requests compute which tokens each step.
- ``kv_cache``: ``KVCacheManager``, the block pool's bookkeeping.
- ``attention``: ``AttentionBackend``, ``AttentionMetadata``, ``ForwardContext``.
- ``model``: ``Model`` (what the executor and the loader need of a model), ``ModelInfo``.
- ``executor``: ``Executor`` and the launched step it returns (``PendingStep``).
- ``quant``: ``QuantMethod``.
- ``proposer``: ``Proposer`` (speculative decoding drafts).
- ``frontend``: ``Frontend``.
- ``engine``: ``EngineCore`` (what the engine-core loop drives) and ``EngineClient``
  (the frontend's async handle on it).
- ``errors``: the errors that cross these interfaces (``QueueFullError``,
  ``EngineError``, ``EngineDeadError``).

Every capability is a declared attribute of its interface with a default; callers
read it directly. torch is imported for type checking only, so the frontend and the
CLI import these modules without it.
"""

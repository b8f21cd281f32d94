"""The contracts between tokenloom's components, and nothing else.

- ``requests``: frontend -> engine-core (generate, abort, health, stats).
- ``outputs``: engine-core -> frontend (token deltas, errors, health and stats replies).
- ``control``: supervisor <-> engine-core (ready handshake, shutdown).
- ``step``: scheduler <-> executor (one engine step's inputs and outputs).
- ``jobs``: external programs <-> the ``zmq`` frontend (the public job protocol).
- ``hookspecs``: the pluggy hook specifications.
- ``components``: the interfaces of every component kind, one module per kind
  (scheduler, kv_cache, attention, model, executor, quant, proposer, frontend,
  engine), the errors that cross them, and the registry record (``ComponentSpec``).
"""

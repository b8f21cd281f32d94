"""Supervisor <-> engine-core control messages (socket ``control``).

The engine-core process sends ``Ready`` once its components are built and it
serves; the supervisor sends ``Shutdown`` to stop it cleanly.
"""

from __future__ import annotations

import msgspec


class Ready(msgspec.Struct, tag="ready", array_like=True, omit_defaults=True, gc=False):
    pid: int
    model_name: str = ""
    max_model_len: int = 0
    num_blocks: int = 0
    block_size: int = 0
    max_num_seqs: int = 0
    eos_token_ids: list[int] = []
    vocab_size: int = 0  # the model's (its embedding rows); 0: unknown


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, omit_defaults=True, gc=False):
    grace_s: float = 5.0  # finish in-flight work for at most this long, then abort it


class Failed(msgspec.Struct, tag="failed", array_like=True, omit_defaults=True, gc=False):
    message: str  # why start-up failed, traceback included


ControlMessage = Ready | Shutdown | Failed

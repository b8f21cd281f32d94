"""``serde.Decoder`` on hostile bytes: deep nesting (which makes msgspec raise
RecursionError) and malformed tensor references become ``DecodeError`` 400, never an
exception that escapes the channel's handler."""

from __future__ import annotations

from typing import Any

import pytest

from tokenloom.protocols.outputs import EngineOutput
from tokenloom.protocols.requests import EngineInput
from tokenloom.transport.serde import DecodeError, Decoder

DEEP = [
    b"\x91" * 1000 + b"\xc0",
    b"\x81\xa1k" * 5000 + b"\xc0",
    b"\x92\xa8generate" + b"\x91" * 100_000 + b"\xc0",
    b"\xc7\x05\x01" + b"\x91" * 5,  # a tensor extension whose reference is garbage
]


@pytest.mark.parametrize("union", [EngineInput, EngineOutput, Any])
@pytest.mark.parametrize("frame", DEEP)
def test_hostile_frames_raise_decode_error_400(union, frame):
    with pytest.raises(DecodeError) as info:
        Decoder(union, 1 << 20).decode([frame])
    assert info.value.code == 400

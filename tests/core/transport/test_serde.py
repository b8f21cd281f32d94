"""serde: frames, zero-copy tensors, refusals with a reason, lazy torch."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch

from tokenloom.protocols.outputs import EngineOutput, ErrorReply
from tokenloom.protocols.requests import EngineInput, GenerateRequest, HealthRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.tensors import Array, Tensor
from tokenloom.transport.serde import DecodeError, Decoder, Encoder


class Activations(msgspec.Struct, tag="acts", array_like=True, omit_defaults=True, gc=False):
    step_id: int
    hidden: Tensor  # [T, H]
    mask: Array | None = None  # [T]
    extra: list[Tensor] = []


def address(buf: object) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)  # type: ignore[call-overload]


def test_plain_message_is_one_frame_and_round_trips() -> None:
    req = GenerateRequest("r1", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5))
    frames = Encoder().encode(req)
    assert len(frames) == 1
    assert Decoder(EngineInput, 1 << 20).decode(frames) == req


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_tensor_round_trips_as_an_extra_frame_without_copies(dtype: torch.dtype) -> None:
    hidden = torch.arange(24).reshape(4, 6).to(dtype)
    frames = Encoder().encode(Activations(1, hidden))
    assert len(frames) == 2
    assert address(frames[1]) == hidden.data_ptr()  # the sender does not copy
    out = Decoder(Activations, 1 << 20).decode(frames)
    assert out.hidden.dtype == dtype and out.hidden.shape == (4, 6)
    assert torch.equal(out.hidden, hidden)
    assert out.hidden.data_ptr() == address(frames[1])  # nor does the receiver


def test_every_tensor_and_array_gets_its_own_frame() -> None:
    msg = Activations(
        2, torch.ones(3, 2), np.arange(3, dtype=np.int32), [torch.zeros(0), torch.tensor(5.0)]
    )
    frames = Encoder().encode(msg)
    assert len(frames) == 5
    out = Decoder(Activations, 1 << 20).decode(frames)
    assert torch.equal(out.hidden, msg.hidden)
    assert out.mask.dtype == np.int32 and out.mask.tolist() == [0, 1, 2]
    assert out.extra[0].shape == (0,) and out.extra[1].item() == 5.0


def test_non_contiguous_tensor_is_sent_contiguous() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    out = Decoder(Activations, 1 << 20).decode(Encoder().encode(Activations(0, base.t())))
    assert torch.equal(out.hidden, base.t())


def test_objects_that_are_not_messages_or_tensors_are_refused() -> None:
    with pytest.raises(NotImplementedError):
        Encoder().encode(Activations(0, object()))  # type: ignore[arg-type]


def test_malformed_bytes_are_a_400_decode_error() -> None:
    with pytest.raises(DecodeError) as err:
        Decoder(EngineInput, 1 << 20).decode([b"\xc1\xc1"])
    assert err.value.code == 400 and "malformed" in err.value.reason


def test_a_message_of_another_channel_is_a_400_decode_error() -> None:
    frames = Encoder().encode(ErrorReply(500, "boom"))
    with pytest.raises(DecodeError) as err:
        Decoder(EngineInput, 1 << 20).decode(frames)
    assert err.value.code == 400
    assert Decoder(EngineOutput, 1 << 20).decode(frames) == ErrorReply(500, "boom")


def test_a_message_over_the_maximum_size_is_a_413_decode_error() -> None:
    frames = Encoder().encode(GenerateRequest("r", list(range(1000)), SamplingParams()))
    with pytest.raises(DecodeError) as err:
        Decoder(EngineInput, 100).decode(frames)
    assert err.value.code == 413
    assert "exceeds" in err.value.reason


def test_tensor_frames_count_toward_the_maximum_size() -> None:
    frames = Encoder().encode(Activations(0, torch.zeros(1000)))
    assert len(frames[0]) < 100
    with pytest.raises(DecodeError) as err:
        Decoder(Activations, 1000).decode(frames)
    assert err.value.code == 413


def test_a_tensor_reference_to_a_missing_or_short_frame_is_refused() -> None:
    frames = Encoder().encode(Activations(0, torch.zeros(4)))
    decoder = Decoder(Activations, 1 << 20)
    with pytest.raises(DecodeError, match="frame 1 missing"):
        decoder.decode(frames[:1])
    with pytest.raises(DecodeError, match="needs 16 bytes"):
        decoder.decode([frames[0], b"\x00" * 8])


def test_decoders_are_reusable_after_an_error() -> None:
    decoder = Decoder(EngineInput, 1 << 20)
    with pytest.raises(DecodeError):
        decoder.decode([b""])
    assert decoder.decode(Encoder().encode(HealthRequest(3))) == HealthRequest(3)


def test_serde_and_the_protocols_do_not_import_torch() -> None:
    code = (
        "import sys, tokenloom.transport.serde, tokenloom.protocols.requests, tokenloom.protocols.outputs,"
        " tokenloom.protocols.tensors, tokenloom.engine.client, tokenloom.transport.sockets\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

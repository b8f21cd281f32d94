"""From a draw on the device to the step's output on the host, in two types.

``Sampler.sample`` returns a ``SampleResult`` (device tensors). The executor feeds
its ids to the next step and the penalties on the device, then starts their copy to
pinned host memory with ``copy_to_host``, which returns a ``PendingSample``: the
launched step the engine holds while it builds the next one. ``result`` waits for
the copy (the step's one host sync) and builds the ``StepOutput`` from it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenloom.plugins.executor.prompt_logprobs import to_host as prompt_values_to_host
from tokenloom.protocols.components.executor import PendingStep
from tokenloom.protocols.outputs import TopLogprobs
from tokenloom.protocols.step import StepOutput


@dataclass(slots=True)
class SampleResult:
    """A draw, kept on the device so that the next step and the penalties read it
    without waiting for the host."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32: logprob of the sampled token
    top_ids: torch.Tensor | None = None  # [B, K] int64, K = largest k asked for
    top_logprobs: torch.Tensor | None = None  # [B, K] float32, descending
    num_logprobs: Sequence[int] = ()  # host, per row: k asked for (-1 = none)
    stored: bool = False  # the draw also stored the ids for the next step (Sampler.sample)

    def copy_to_host(
        self,
        step_id: int,
        request_ids: list[str],
        prompt_values: list[torch.Tensor | None] | None = None,
    ) -> PendingSample:
        """Start copying the result to the host (pinned memory, asynchronous on CUDA)
        as the output of step ``step_id``, row i for ``request_ids[i]``;
        ``prompt_values`` are the rows' prompt logprobs, where any are due."""
        if self.logprobs is None or self.top_ids is None or self.top_logprobs is None:
            return PendingSample(step_id, request_ids, self.token_ids, 0, (), prompt_values)
        # float64 holds every token id exactly, so one tensor carries all fields.
        packed = torch.cat(
            (
                self.token_ids.unsqueeze(1).double(),
                self.logprobs.unsqueeze(1).double(),
                self.top_ids.double(),
                self.top_logprobs.double(),
            ),
            dim=1,
        )  # [B, 2 + 2K]
        width = self.top_ids.shape[1]
        return PendingSample(step_id, request_ids, packed, width, self.num_logprobs, prompt_values)

    def to_step_output(self, step_id: int, request_ids: list[str]) -> StepOutput:
        """Read the result to the host now (one device sync)."""
        return self.copy_to_host(step_id, request_ids).result()


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


class PendingSample(PendingStep):
    """A launched step whose sampled ids are on their way to the host: what the
    engine holds while it builds the next step."""

    def __init__(
        self,
        step_id: int,
        request_ids: list[str],
        device_values: torch.Tensor,  # [B] ids, or [B, 2 + 2 * width] packed with logprobs
        width: int,  # K of the packed logprobs layout; 0 = token ids only
        num_logprobs: Sequence[int],
        prompt_values: list[torch.Tensor | None] | None = None,
    ) -> None:
        self.step_id = step_id
        self.request_ids = request_ids
        self.width = width
        self.num_logprobs = num_logprobs
        self.prompt_values = prompt_values
        self._host = device_values  # on the CPU, the values are already on the host
        self._done: torch.cuda.Event | None = None
        if device_values.device.type == "cuda":
            # On a side stream: the next step's work, queued next on the compute stream,
            # does not wait for this copy (~8 us at batch 1 on an H200).
            host = torch.empty(device_values.shape, dtype=device_values.dtype, pin_memory=True)
            stream = _copy_stream(device_values.device)
            stream.wait_stream(torch.cuda.current_stream(device_values.device))
            with torch.cuda.stream(stream):
                host.copy_(device_values, non_blocking=True)
                self._done = torch.cuda.Event()
                self._done.record(stream)
            device_values.record_stream(stream)  # not reused before the copy is done
            self._host = host

    def result(self) -> StepOutput:
        """Wait for the copy and build the step's output: one token per request."""
        if self._done is not None:
            self._done.synchronize()
        output = StepOutput(self.step_id, self.request_ids, [])
        if not self.width and not self.num_logprobs:
            output.token_ids = [[t] for t in self._host.tolist()]
        else:
            packed = self._host.tolist()
            width = self.width
            tops = []
            for row, k in zip(packed, self.num_logprobs, strict=True):
                k = max(k, 0)
                ids = [int(t) for t in row[2 : 2 + k]]
                tops.append([TopLogprobs(ids, row[2 + width : 2 + width + k])])
            output.token_ids = [[int(row[0])] for row in packed]
            output.logprobs = [[row[1]] for row in packed]
            output.top_logprobs = tops
        if self.prompt_values is not None:
            output.prompt_logprobs = prompt_values_to_host(self.prompt_values)
        return output

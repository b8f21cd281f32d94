"""Prompt logprobs: the log-probability of each prompt token given the tokens before it.

For a request whose ``SamplingParams.prompt_logprobs`` is set, every chunk that
computes prompt positions also computes full logits at those rows (log_softmax in
float32, the raw model distribution, like the sampled-token logprobs) and keeps the
logprob of the prompt's next token. The row at position ``p`` predicts prompt token
``p + 1``, so a prompt of ``P`` tokens has ``P - 1`` values (the first token has no
context). Chunked prefill fills the values chunk by chunk, each at its positions; a
preempted request that recomputes its prompt overwrites them with the same values.

The values are read to the host once, in the step whose chunk reaches the prompt's
end (the one that samples the first output token), and delivered with that step's
``StepOutput.prompt_logprobs``. Only requests that ask pay anything: the per-step
cost for others is one dict lookup per chunk. The scheduler keeps such requests out
of the prefix cache, since positions served from it are never computed here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from tokenloom.protocols.step import NewRequestData, ScheduledChunk

ROWS_PER_SLICE = 512  # full-vocabulary logits are computed this many rows at a time


class PromptLogprobs:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._prompts: dict[str, list[int]] = {}
        self._values: dict[str, torch.Tensor] = {}  # [P - 1] float32 device
        self._delivered: set[str] = set()

    def add_request(self, data: NewRequestData) -> None:
        if not data.params.prompt_logprobs:
            return
        prompt = data.prompt_token_ids
        self._prompts[data.request_id] = prompt
        size = max(len(prompt) - 1, 0)
        self._values[data.request_id] = torch.full(
            (size,), float("nan"), dtype=torch.float32, device=self.device
        )

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._prompts.pop(request_id, None)
            self._values.pop(request_id, None)
            self._delivered.discard(request_id)

    def wanted(self) -> bool:
        return bool(self._prompts)

    def record(
        self,
        chunks: list[ScheduledChunk],
        hidden: torch.Tensor,  # [T, hidden] the step's rows, chunk after chunk
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Fill the values of the prompt positions this step computed."""
        row = 0
        prompts = self._prompts
        for chunk in chunks:
            q = len(chunk.token_ids)
            prompt = prompts.get(chunk.request_id)
            if prompt is not None:
                start = chunk.start_pos
                end = min(start + q, len(prompt) - 1)  # positions < end predict a prompt token
                if end > start:
                    values = self._values[chunk.request_id]
                    targets = torch.tensor(prompt[start + 1 : end + 1], device=self.device)
                    for lo in range(0, end - start, ROWS_PER_SLICE):
                        hi = min(lo + ROWS_PER_SLICE, end - start)
                        logits = compute_logits(hidden[row + lo : row + hi]).float()
                        logprobs = torch.log_softmax(logits, dim=-1)
                        picked = logprobs.gather(1, targets[lo:hi].unsqueeze(1)).squeeze(1)
                        values[start + lo : start + hi] = picked
            row += q

    def take(
        self, chunks: list[ScheduledChunk], request_ids: list[str]
    ) -> list[torch.Tensor | None] | None:
        """The finished prompt values for the step's sampled requests (``request_ids``,
        in chunk order), each at most once: for a request whose sampling chunk reaches
        its prompt's end. None when no request in the step has any to deliver."""
        prompts = self._prompts
        if not prompts:
            return None
        ready: dict[str, torch.Tensor] = {}
        for chunk in chunks:
            request_id = chunk.request_id
            prompt = prompts.get(request_id)
            if prompt is None or not chunk.sample or request_id in self._delivered:
                continue
            if chunk.start_pos + len(chunk.token_ids) >= len(prompt):
                self._delivered.add(request_id)
                ready[request_id] = self._values[request_id].clone()
        if not ready:
            return None
        return [ready.get(request_id) for request_id in request_ids]


def to_host(values: list[torch.Tensor | None]) -> list[list[float] | None]:
    return [None if v is None else v.tolist() for v in values]

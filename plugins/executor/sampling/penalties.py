"""Repetition, presence and frequency penalties, and the token counts they read.

Semantics:
- repetition (Hugging Face): for every token seen in the prompt or the output, a
  positive logit is divided by the penalty and a negative one multiplied by it.
- presence and frequency (OpenAI), over generated tokens only:
  ``logit -= frequency * count + presence * (count > 0)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenloom.plugins.executor.staging import upload


def apply_penalties(
    logits: torch.Tensor,  # [P, V] float32
    output_counts: torch.Tensor,  # [P, V] int32: times each token was generated
    prompt_mask: torch.Tensor,  # [P, V] bool: token occurs in the prompt
    repetition: torch.Tensor,  # [P, 1] float32 (1.0 = off)
    presence: torch.Tensor,  # [P, 1] float32 (0.0 = off)
    frequency: torch.Tensor,  # [P, 1] float32 (0.0 = off)
) -> torch.Tensor:  # [P, V] float32, a new tensor
    """The penalised logits. Rows whose penalties are off come back unchanged."""
    generated = output_counts > 0
    seen = prompt_mask | generated
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    penalised = torch.where(seen, repeated, logits)
    penalised -= frequency * output_counts
    penalised -= presence * generated
    return penalised


class TokenCounts:
    """Per-request token statistics on the device, for the penalties.

    Each tracked request owns one row ("slot") of two pool tensors: ``output_counts``
    (how often each token was generated) and ``prompt_mask`` (tokens in its prompt).
    Slots are stable while a request lives and are reused after ``remove``; the pool
    doubles when full. Only requests with a penalty are tracked, so batches without
    penalties cost nothing. Updates are device ops fed by one small host copy.
    """

    def __init__(self, vocab_size: int, device: torch.device, initial_slots: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros(
            initial_slots, vocab_size, dtype=torch.int32, device=device
        )
        self.prompt_mask = torch.zeros(initial_slots, vocab_size, dtype=torch.bool, device=device)
        self._slots: dict[str, int] = {}
        self._free = list(range(initial_slots - 1, -1, -1))
        self._one = torch.ones(1, dtype=torch.int32, device=device)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slots

    def slot(self, request_id: str) -> int:
        return self._slots[request_id]

    def add(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Start tracking a request: zero counts, prompt mask from its prompt."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slots[request_id] = slot
        self.output_counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        in_vocab = [t for t in prompt_token_ids if 0 <= t < self.vocab_size]
        if in_vocab:
            ids = upload(torch.tensor(in_vocab, dtype=torch.int64), self.device)
            self.prompt_mask[slot].index_fill_(0, ids, True)

    def remove(self, request_id: str) -> None:
        """Stop tracking a request (unknown ids are ignored)."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def record(self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        """Count newly generated tokens; untracked requests are skipped."""
        slots: list[int] = []
        tokens: list[int] = []
        for request_id, new_ids in zip(request_ids, token_ids, strict=True):
            slot = self._slots.get(request_id)
            if slot is None:
                continue
            for token_id in new_ids:
                if 0 <= token_id < self.vocab_size:
                    slots.append(slot)
                    tokens.append(token_id)
        if not slots:
            return
        index = upload(torch.tensor([slots, tokens], dtype=torch.int64), self.device)
        self.output_counts.index_put_(
            (index[0], index[1]), self._one.expand(len(slots)), accumulate=True
        )

    def record_on_device(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one generated token per slot, both given as device tensors (no host
        read: the tokens may still be being sampled)."""
        self.output_counts.index_put_(
            (slots, token_ids.long()), self._one.expand(slots.shape[0]), accumulate=True
        )

    def _grow(self) -> None:
        old = self.output_counts.shape[0]
        new = old * 2
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        mask = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.output_counts
        mask[:old] = self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask
        self._free.extend(range(new - 1, old - 1, -1))

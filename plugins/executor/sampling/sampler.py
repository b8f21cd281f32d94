"""The device sampler: logits of the rows that sample -> one token id per row.

Order of processing, per row: penalties (repetition, presence, frequency) and the
min_tokens mask, then temperature, top-k, top-p, min-p, then one exponential-race
draw. Greedy rows (temperature 0) take the argmax of the penalised logits. Logprobs
are those of the raw model distribution (log_softmax of the unprocessed logits).

On a GPU, a batch that samples with temperature only (no top-k, top-p or min-p, no
seeded row) skips the softmax and the noise tensor: its (penalised) logits go straight
into one fused Gumbel-max kernel with each row's temperature (``fused_sample``), one
pass over the logits instead of five. Every other batch takes the unfused path.

Everything runs on the device and is vectorised over the batch; the only host work
per step is comparing the batch key and, for rows still short of min_tokens, one
small index copy. Nothing here reads a device value on the host: the executor does
that once, through ``SampleResult.copy_to_host`` (an asynchronous copy it waits for
only when it needs the ids; see ``result``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from tokenloom.plugins.executor.sampling.logits_filters import (
    apply_min_p,
    apply_top_k,
    apply_top_k_top_p,
    exponential_race,
)
from tokenloom.plugins.executor.sampling.penalties import TokenCounts, apply_penalties
from tokenloom.plugins.executor.sampling.result import SampleResult
from tokenloom.plugins.executor.sampling.sampling_batch import (
    RequestSamplingState,
    SamplingBatch,
    build_sampling_batch,
)
from tokenloom.plugins.executor.staging import upload
from tokenloom.protocols.step import NewRequestData

if TYPE_CHECKING:  # fused_sample imports Triton; the sampler imports it late
    from tokenloom.plugins.executor.sampling.fused_sample import Store


class Sampler:
    """Per-request sampling state plus the batched sampling of one step.

    Called by the executor in the engine-core process (rank 0), never concurrently.
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._requests: dict[str, RequestSamplingState] = {}
        self._counts = TokenCounts(vocab_size, self.device)
        self._batch: SamplingBatch | None = None
        # The fused draw needs Triton on a GPU; tests set it to run the kernel under
        # TRITON_INTERPRET=1 on the CPU.
        self.use_fused_sample = self.device.type == "cuda"
        self._fused_temperature: tuple[SamplingBatch, torch.Tensor] | None = None

    # ------------------------------------------------------------------ request state

    def add_request(self, data: NewRequestData) -> None:
        """Start keeping state for a request. A request already known keeps its state
        (history and generator), so a re-sent NewRequestData is harmless."""
        if data.request_id in self._requests:
            return
        params = data.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        state = RequestSamplingState(
            params=params,
            generator=generator,
            masked_until_min_tokens=sorted(
                t
                for t in set(data.eos_token_ids) | set(params.stop_token_ids)
                if 0 <= t < self.vocab_size
            ),
        )
        self._requests[data.request_id] = state
        if state.has_penalties:
            self._counts.add(data.request_id, data.prompt_token_ids)
        self._batch = None

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Drop the state of finished requests; unknown ids are ignored."""
        for request_id in request_ids:
            if self._requests.pop(request_id, None) is not None:
                self._counts.remove(request_id)
                self._batch = None

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def num_logprobs(self, request_ids: Sequence[str]) -> list[int]:
        """Per request: top logprobs asked for (0: only the sampled token's; -1: none)."""
        params = [self._requests[r].params for r in request_ids]
        return [-1 if p.logprobs is None else p.logprobs for p in params]

    def count_host_tokens(
        self, request_ids: Sequence[str], token_ids: Sequence[int | Sequence[int]]
    ) -> None:
        """Count each request's accepted tokens (an int, or a list of ints with
        speculation) from host lists, for the penalties and min_tokens; unknown ids are
        ignored."""
        new_ids = [[t] if isinstance(t, int) else list(t) for t in token_ids]
        for request_id, ids in zip(request_ids, new_ids, strict=True):
            state = self._requests.get(request_id)
            if state is not None:
                state.num_output += len(ids)
        self._counts.record(request_ids, new_ids)

    def count_sampled(self, request_ids: Sequence[str], result: SampleResult) -> None:
        """Count the tokens ``sample`` just drew for ``request_ids`` (one per row), on
        the device, without waiting for them: the next step's penalties and
        min_tokens mask see them even before the host has read them. The executor
        calls this or ``count_host_tokens``, not both."""
        batch = self._batch_for(request_ids)
        for row in batch.min_tokens_rows:
            self._requests[batch.key[row]].num_output += 1
        if batch.penalty_rows is not None:
            assert batch.penalty_slots is not None
            self._counts.record_on_device(
                batch.penalty_slots, result.token_ids.index_select(0, batch.penalty_rows)
            )

    # ------------------------------------------------------------------ sampling

    def sample(
        self, logits: torch.Tensor, request_ids: Sequence[str], store: Store | None = None
    ) -> SampleResult:
        """One token per row. ``logits`` is ``[B, V]`` float32 on the device, row i
        belonging to ``request_ids[i]``; it is not modified. ``store`` = ``(tokens,
        slots)``: where the fused kernels draw, they also write ``tokens[slots[i]]``
        (int32), and the result says so (``stored``)."""
        batch = self._batch_for(request_ids)
        stored = False
        if self._takes_fused_draw(batch):
            token_ids, stored = self._fused_draw(logits, batch, store), store is not None
        elif batch.needs_processing:
            token_ids = self._draw(self._process(logits, batch), batch)
        elif self.use_fused_sample:
            token_ids, stored = self._argmax(logits, store), store is not None
        else:
            token_ids = self._argmax(logits)
        if batch.max_logprobs < 0:
            return SampleResult(token_ids, stored=stored)
        raw = logits.log_softmax(dim=-1)  # [B, V]
        top = raw.topk(batch.max_logprobs, dim=-1)  # [B, K] each
        return SampleResult(
            token_ids=token_ids,
            logprobs=raw.gather(1, token_ids.unsqueeze(1)).squeeze(1),
            top_ids=top.indices,
            top_logprobs=top.values,
            num_logprobs=batch.num_logprobs,
            stored=stored,
        )

    def is_plain_argmax(self, request_ids: Sequence[str]) -> bool:
        """True when these rows sample by the argmax of their raw logits (greedy, no
        penalties, no min_tokens mask)."""
        return not self._batch_for(request_ids).needs_processing

    def process_draft_rows(
        self,
        logits: torch.Tensor,  # [R, V] float32
        row_request_ids: Sequence[str],
        row_drafts: Sequence[Sequence[int]],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Speculative verification: the processed distributions of rows that each
        follow some drafts. Row r belongs to ``row_request_ids[r]`` and comes after
        the drafts ``row_drafts[r]`` (as if accepted): its penalties count them and
        its min_tokens mask sees them, exactly as ``sample`` would have one token at
        a time. Returns ``(probs [R, V], greedy [R] bool, uniform [R], noise [R, V])``,
        the draws from each seeded request's own generator in row order."""
        batch = self._batch_for(row_request_ids)
        extra = None
        if batch.penalty_rows is not None and any(row_drafts):
            slots: list[int] = []
            tokens: list[int] = []
            requests = self._requests
            penalty_rows = [
                r for r, rid in enumerate(row_request_ids) if requests[rid].has_penalties
            ]  # the batch's penalty_rows, read on the host
            for index, row in enumerate(penalty_rows):
                for token in row_drafts[row]:
                    if 0 <= token < self.vocab_size:
                        slots.append(index)
                        tokens.append(token)
            if slots:
                extra = torch.zeros(
                    batch.penalty_rows.shape[0],
                    self.vocab_size,
                    dtype=torch.int32,
                    device=self.device,
                )
                index = upload(torch.tensor([slots, tokens], dtype=torch.int64), self.device)
                extra.index_put_((index[0], index[1]), self._counts._one.expand(len(slots)), True)
        offsets = [len(d) for d in row_drafts]
        processed = self._process(logits, batch, extra, offsets)
        probs = processed.softmax(dim=-1)
        num_rows = logits.shape[0]
        greedy = (
            batch.greedy.view(-1)
            if batch.greedy is not None
            else torch.full((num_rows,), batch.all_greedy, dtype=torch.bool, device=self.device)
        )
        uniform = torch.rand(num_rows, device=self.device)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in batch.seeded_rows:
            uniform[row : row + 1].uniform_(generator=generator)
            noise[row].exponential_(generator=generator)
        return probs, greedy, uniform, noise

    def process_logits(self, logits: torch.Tensor, request_ids: Sequence[str]) -> torch.Tensor:
        """The logits the random draw sees: penalties, min_tokens mask, temperature
        (1 on greedy rows), top-k, top-p, min-p. For inspection and tests."""
        return self._process(logits, self._batch_for(request_ids))

    def _batch_for(self, request_ids: Sequence[str]) -> SamplingBatch:
        key = tuple(request_ids)
        if self._batch is None or self._batch.key != key:
            states = [self._requests[r] for r in key]
            slots = [self._counts.slot(r) if r in self._counts else None for r in key]
            self._batch = build_sampling_batch(key, states, slots, self.vocab_size, self.device)
        return self._batch

    def warm_up(self) -> None:
        """Compile the fused draw for this vocabulary now, at start-up: Triton compiles
        on first use, on the engine thread, so the first temperature-sampled step of a
        fresh server (a cold Triton cache) stalled every request in flight."""
        if not self.use_fused_sample:
            return
        from tokenloom.plugins.executor.sampling import fused_sample  # Triton, imported late

        logits = torch.zeros(1, self.vocab_size, dtype=torch.float32, device=self.device)
        one = torch.ones(1, dtype=torch.float32, device=self.device)
        slots = torch.zeros(1, dtype=torch.int32, device=self.device)
        store = (torch.zeros(1, dtype=torch.int32, device=self.device), slots)
        for to in (None, store):  # the executor stores the token; the proposers do not
            fused_sample.fused_sample(logits, one, fused_sample.host_seed(), store=to)
            fused_sample.greedy_argmax(logits, store=to)
        # The draw's own store (one split a row: batches of 16 rows an SM and up)
        fused_sample.fused_sample(logits, one, fused_sample.host_seed(), 1, store=store)
        fused_sample.fused_sample(logits, None, 2**32, 1, store=store)

    def _argmax(self, logits: torch.Tensor, store: Store | None = None) -> torch.Tensor:
        """Greedy ids: the fused kernel's split argmax where the fused draw runs (a GPU;
        ``store`` as in ``sample``, ignored elsewhere)."""
        if not self.use_fused_sample:
            return logits.argmax(dim=-1)
        from tokenloom.plugins.executor.sampling import fused_sample  # Triton, imported late

        return fused_sample.greedy_argmax(logits, store)

    def _takes_fused_draw(self, batch: SamplingBatch) -> bool:
        """True when temperature is all the processing after the penalties: no filter
        (they need the divided logits), no seeded row (it keeps its own generator's
        stream), and some row samples."""
        return (
            self.use_fused_sample
            and not batch.all_greedy
            and not batch.seeded_rows
            and batch.top_k is None
            and batch.top_p is None
            and batch.min_p is None
        )

    def _fused_draw(
        self, logits: torch.Tensor, batch: SamplingBatch, store: Store | None = None
    ) -> torch.Tensor:
        """Penalties and min_tokens mask, then the one-pass draw with each row's
        temperature: the raw logits go straight into the kernel when no row needs those."""
        from tokenloom.plugins.executor.sampling import fused_sample  # Triton, imported late

        return fused_sample.fused_sample(
            self._penalise(logits, batch),
            self._temperature_or_zero(batch),
            fused_sample.host_seed(),
            store=store,
        )

    def _temperature_or_zero(self, batch: SamplingBatch) -> torch.Tensor:  # [B] float32
        """The rows' temperatures with 0 on greedy rows, as ``fused_sample`` takes them;
        made once per batch composition."""
        if self._fused_temperature is None or self._fused_temperature[0] is not batch:
            assert batch.temperature is not None
            temperature = batch.temperature.view(-1)
            if batch.greedy is not None:
                temperature = temperature.masked_fill(batch.greedy.view(-1), 0.0)
            self._fused_temperature = (batch, temperature)
        return self._fused_temperature[1]

    def _process(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        extra_counts: torch.Tensor | None = None,
        row_offsets: Sequence[int] | None = None,
    ) -> torch.Tensor:
        logits = self._penalise(logits, batch, extra_counts, row_offsets)
        if not batch.all_greedy:
            assert batch.temperature is not None
            logits = logits / batch.temperature
            if batch.top_p is not None:
                logits = apply_top_k_top_p(
                    logits, batch.top_k, batch.top_p, batch.max_top_k if batch.all_top_k else None
                )
            elif batch.top_k is not None:
                assert batch.top_k_off is not None
                logits = apply_top_k(logits, batch.top_k, batch.max_top_k, batch.top_k_off)
            if batch.min_p is not None:
                logits = apply_min_p(logits, batch.min_p)
        return logits

    def _penalise(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        extra_counts: torch.Tensor | None = None,  # [P, V] int32: drafts before each row
        row_offsets: Sequence[int] | None = None,  # per row: output tokens not yet counted
    ) -> torch.Tensor:
        """Penalties and the min_tokens mask; returns a new tensor when it changes any."""
        if batch.penalty_rows is not None:
            assert batch.penalty_slots is not None
            assert batch.repetition is not None
            assert batch.presence is not None and batch.frequency is not None
            rows, slots = batch.penalty_rows, batch.penalty_slots
            counts = self._counts.output_counts.index_select(0, slots)
            if extra_counts is not None:
                counts += extra_counts
            penalised = apply_penalties(
                logits.index_select(0, rows),
                counts,
                self._counts.prompt_mask.index_select(0, slots),
                batch.repetition,
                batch.presence,
                batch.frequency,
            )  # [P, V]
            logits = logits.index_copy(0, rows, penalised)
        masked: list[int] = []  # flat indices row * V + token into the [B, V] logits
        for row in batch.min_tokens_rows:
            state = self._requests[batch.key[row]]
            offset = row_offsets[row] if row_offsets is not None else 0
            if state.num_output + offset < state.params.min_tokens:
                masked.extend(row * self.vocab_size + t for t in state.masked_until_min_tokens)
        if masked:
            if batch.penalty_rows is None:
                logits = logits.clone()
            index = upload(torch.tensor(masked, dtype=torch.int64), self.device)
            # index_fill_ takes the value as a kernel argument; an indexed assignment of a
            # Python scalar would copy it to the device with a sync.
            logits.view(-1).index_fill_(0, index, float("-inf"))
        return logits

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.all_greedy:
            return self._argmax(logits)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()  # unseeded rows share this draw
        for row, generator in batch.seeded_rows:
            noise[row].exponential_(generator=generator)
        if batch.greedy is not None:
            noise.masked_fill_(batch.greedy, 1.0)  # no noise: the argmax of the probs
        return exponential_race(probs, noise)

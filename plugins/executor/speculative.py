"""Speculative decoding in the executor: verify the drafts of a step, then propose.

The scheduler schedules a speculating request's chunk as ``[last token, d_1 .. d_k]``
(``num_draft_tokens = k``); the forward pass computes all ``k + 1`` positions on the
attention's extend path, and the batch keeps the logits of all of them. Here:

1. ``sample``: the sampler turns those rows into the same processed distributions
   it samples from (penalties and min_tokens counting the drafts before each row,
   temperature, top-k/p, min-p, each request's generator); ``rejection_sample``
   accepts a prefix of the drafts and adds one token (correction or bonus). Steps
   without drafts sample as usual. One host copy reads the tokens (and logprobs).
2. ``propose``: each speculating request's history (prompt + accepted output, kept
   here on the host) goes to the proposer, whose drafts return to the scheduler in
   ``StepOutput.draft_token_ids``.

Speculation needs each step's tokens on the host before the next step is built.
With async scheduling the engine therefore runs a step synchronously while any
request speculates (``engine_core``), and the runner takes this path only for a
step with a speculating request (``speculating``); every other step samples on the
device as usual, keeping its tokens there for the placeholders of a pipelined next
step. A step on this path is not followed by one with placeholders (the engine has
its tokens before it schedules again); it keeps each request's last token on the
device all the same, so the tokens stay exact should a step of it be pipelined.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from tokenloom.config import EngineConfig, speculative_tokens
from tokenloom.plugins.executor.prompt_logprobs import to_host as prompt_values_to_host
from tokenloom.plugins.executor.sampling.rejection import (
    greedy_verify,
    rejection_sample,
    row_layout,
)
from tokenloom.plugins.executor.sampling.sampler import Sampler
from tokenloom.plugins.executor.staging import upload
from tokenloom.protocols.components.proposer import Proposer
from tokenloom.protocols.outputs import TopLogprobs
from tokenloom.protocols.step import NewRequestData, ScheduledChunk, StepOutput


class SpeculativeDecoder:
    """The executor's speculative half: per-request histories and the proposer."""

    def __init__(self, config: EngineConfig, proposer: Proposer, sampler: Sampler) -> None:
        self.config = config
        self.proposer = proposer
        self.sampler = sampler
        self._k: dict[str, int] = {}  # speculating requests -> drafts per step
        self._histories: dict[str, list[int]] = {}  # prompt + accepted output

    # ------------------------------------------------------------------ request state

    def add_request(self, data: NewRequestData) -> None:
        k = speculative_tokens(self.config, data.params)
        if k <= 0 or data.request_id in self._k:
            return
        self._k[data.request_id] = k
        self._histories[data.request_id] = list(data.prompt_token_ids)
        self.proposer.add_request(data)

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        gone = [r for r in request_ids if self._k.pop(r, None) is not None]
        for request_id in gone:
            del self._histories[request_id]
        if gone:
            self.proposer.remove_requests(gone)

    def speculating(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether a chunk that samples belongs to a speculating request: such a step
        goes through ``sample`` (verify, then propose from the host tokens)."""
        ks = self._k
        return bool(ks) and any(c.sample and c.request_id in ks for c in chunks)

    # ------------------------------------------------------------------ one step

    def sample(
        self,
        step_id: int,
        chunks: Sequence[ScheduledChunk],
        logits: torch.Tensor,  # [R, V]: k + 1 rows per sampling chunk with k drafts
        request_ids: list[str],
        prompt_values: list[torch.Tensor | None] | None,
        keep_last: Callable[[torch.Tensor], None] | None = None,
    ) -> StepOutput:
        """The step's output with every sampled request's tokens, on the host.
        ``keep_last`` gets each sampled request's last new token on the device (the
        runner keeps them for placeholders, as on its usual path: correct tokens do
        not rest on the engine never pipelining after such a step)."""
        sampler = self.sampler
        drafts = [c.token_ids[len(c.token_ids) - c.num_draft_tokens :] for c in chunks if c.sample]
        if not any(drafts):
            result = sampler.sample(logits, request_ids)
            sampler.count_sampled(request_ids, result)
            if keep_last is not None:
                keep_last(result.token_ids)
            output = result.to_step_output(step_id, request_ids)
        else:
            output = self._verify(step_id, logits, request_ids, drafts, keep_last)
            sampler.count_host_tokens(request_ids, output.token_ids)
        if prompt_values is not None:
            output.prompt_logprobs = prompt_values_to_host(prompt_values)
        self._propose(output)
        return output

    def _verify(
        self,
        step_id: int,
        logits: torch.Tensor,
        request_ids: list[str],
        drafts: list[list[int]],
        keep_last: Callable[[torch.Tensor], None] | None = None,
    ) -> StepOutput:
        device = logits.device
        row_ids: list[str] = []
        row_drafts: list[list[int]] = []  # drafts before each row
        verified: list[int] = []  # the draft each row verifies; -1 on the last row
        for request_id, request_drafts in zip(request_ids, drafts, strict=True):
            for j in range(len(request_drafts) + 1):
                row_ids.append(request_id)
                row_drafts.append(request_drafts[:j])
                verified.append(request_drafts[j] if j < len(request_drafts) else -1)
        layout_host = row_layout([len(d) for d in drafts])
        sampler = self.sampler
        flat = verified + [row for request_rows in layout_host for row in request_rows]
        packed = upload(torch.tensor(flat, dtype=torch.int64), device)
        draft_rows, layout = packed[: len(verified)], packed[len(verified) :]
        layout = layout.view(len(drafts), -1)
        if sampler.is_plain_argmax(row_ids):
            tokens, num_accepted = greedy_verify(logits.argmax(dim=-1), draft_rows, layout)
        else:
            probs, greedy, uniform, noise = sampler.process_draft_rows(logits, row_ids, row_drafts)
            tokens, num_accepted = rejection_sample(
                probs, draft_rows, greedy, layout, uniform, noise
            )
        if keep_last is not None:  # the correction or bonus token ends each row
            keep_last(tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1))
        values = [tokens.double(), num_accepted.double().unsqueeze(1)]
        asked = sampler.num_logprobs(request_ids)
        want = max(asked, default=-1)
        if want >= 0:
            raw = logits.log_softmax(dim=-1)  # the target's, as ``sample`` reports
            rows = layout.clamp(min=0)
            chosen = raw[rows.view(-1)].gather(1, tokens.view(-1, 1)).view_as(tokens)
            values.append(chosen.double())
            if want > 0:
                top = raw[rows.view(-1)].topk(want, dim=-1)  # [B * (K + 1), want]
                values += [top.indices.double().view(len(drafts), -1)]
                values += [top.values.double().view(len(drafts), -1)]
        host = torch.cat(values, dim=1).cpu().tolist()  # the step's one host sync
        width = tokens.shape[1]
        output = StepOutput(step_id, request_ids, [])
        logprobs: list[list[float]] = []
        tops: list[list[TopLogprobs]] = []
        for row, k in zip(host, asked, strict=True):
            count = int(row[width]) + 1
            output.token_ids.append([int(t) for t in row[:count]])
            if want < 0:
                continue
            logprobs.append(row[width + 1 : width + 1 + count])
            k = max(k, 0)
            base = 2 * width + 1
            entries = []
            for j in range(count):
                ids = row[base + j * want : base + j * want + k]
                vals = row[base + width * want + j * want : base + width * want + j * want + k]
                entries.append(TopLogprobs([int(t) for t in ids], vals))
            tops.append(entries)
        if want >= 0:
            output.logprobs = logprobs
            output.top_logprobs = tops
        return output

    def _propose(self, output: StepOutput) -> None:
        """Drafts for the next step of each speculating request in ``output``."""
        ks = self._k
        if not ks:
            return
        histories = self._histories
        ids: list[str] = []
        for request_id, new_ids in zip(output.request_ids, output.token_ids, strict=True):
            history = histories.get(request_id)
            if history is not None:
                history += new_ids
                ids.append(request_id)
        if not ids:
            return
        proposed = self.proposer.propose(ids, [histories[r] for r in ids], [ks[r] for r in ids])
        by_id = dict(zip(ids, proposed, strict=True))
        output.draft_token_ids = [by_id.get(r, [])[: ks.get(r, 0)] for r in output.request_ids]

"""The simulated executor: the engine's executor with the GPU replaced by a cost model.

``execute`` honours the step contract (one sampled id per chunk with ``sample=True``,
in chunk order) without a model or a tensor: the sampled id is always ``TOKEN``;
requests stop by length (the simulator sends ``max_tokens`` = the trace's output
length with ``ignore_eos``). What it adds is the step's predicted duration, and the
per-request observations only an executor sees: the first step that computes a
request (its queue time ends) and recomputation after a preemption (a chunk that
starts before the position the request already reached).
"""

from __future__ import annotations

from tokenloom.protocols.components.executor import Executor
from tokenloom.protocols.components.model import ModelInfo
from tokenloom.protocols.step import StepInput, StepOutput
from tokenloom.sim.cost_model import CostModel, StepFeatures, graph_sizes, step_features

TOKEN = 1  # the sampled id; never a stop id (requests ignore EOS)


class SimExecutor(Executor):
    """Built by the simulator, not by the plugin manager: it needs the cost model."""

    def __init__(
        self,
        cost: CostModel,
        max_num_seqs: int,
        enforce_eager: bool = False,
        max_graph_batch: int = 512,
    ) -> None:
        self.cost = cost
        self.sizes = [] if enforce_eager else graph_sizes(max_num_seqs, max_graph_batch)
        self.reached: dict[str, int] = {}  # request -> end of its last chunk
        self.high: dict[str, int] = {}  # request -> furthest position it ever computed
        self.num_recomputed_tokens = 0
        self.preempted: dict[str, int] = {}  # request -> times it restarted from scratch
        self.started: list[str] = []  # requests first computed by the last step
        self.last_features: StepFeatures | None = None

    def load_model(self) -> ModelInfo:  # pragma: no cover - not part of the simulation
        raise NotImplementedError("the simulator builds its executor around a cost model")

    def num_kv_blocks(self, block_size: int) -> int:  # pragma: no cover
        raise NotImplementedError("the simulator is given the number of KV blocks")

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        return None

    def execute(self, step: StepInput) -> StepOutput:
        reached, high = self.reached, self.high
        for request_id in step.finished_request_ids:
            reached.pop(request_id, None)
            high.pop(request_id, None)
        self.started = [new.request_id for new in step.new_requests]
        request_ids: list[str] = []
        for chunk in step.chunks:
            request_id = chunk.request_id
            start = chunk.start_pos
            end = start + len(chunk.token_ids)
            if start < reached.get(request_id, 0):  # starts over: it was preempted
                self.preempted[request_id] = self.preempted.get(request_id, 0) + 1
            top = high.get(request_id, 0)
            if start < top:
                self.num_recomputed_tokens += min(end, top) - start
            if end > top:
                high[request_id] = end
            reached[request_id] = end
            if chunk.sample:
                request_ids.append(request_id)
        return StepOutput(step.step_id, request_ids, [[TOKEN] for _ in request_ids])

    def step_time(self, step: StepInput) -> float:
        """Seconds the GPU would take for ``step`` (call before or after ``execute``)."""
        features = step_features(step, self.sizes)
        self.last_features = features
        return self.cost.step_time(features)

"""A new scheduler in one short file, tested on the CPU against the default.

Shortest-prompt-first: requests with shorter prompts get admitted first, which
lowers the mean time to finish when short and long requests arrive together. It
reuses the default continuous scheduler and overrides two public extension points
(``plugins/scheduler/policy.py``; ``protocols/README.md``, "Writing a scheduler"):
``priority(state, now)``, the waiting queue's key, and ``choose_victim``, which
request gives its KV blocks back when the pool runs dry. The request itself is
left as the client sent it.

    python examples/custom_scheduler.py
"""

import tempfile

from tokenloom import LLM, SamplingParams
from tokenloom.checkpoints.tiny_models import write_tiny_model
from tokenloom.plugins.scheduler.continuous import ContinuousScheduler
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl
from tokenloom.protocols.requests import GenerateRequest


class ShortestPromptFirst(ContinuousScheduler):
    def priority(self, state, now):
        # Lower runs sooner; ties in arrival order. The client's own priority first.
        return (state.priority, state.num_prompt_tokens, state.arrival_seq)

    def choose_victim(self, candidates):
        # Preempt the request this order ranks last (the longest prompt): it would
        # wait longest anyway, and short ones keep their blocks.
        return max(candidates, key=lambda state: self.priority(state, self.now))


class MyPlugin:
    @hookimpl
    def tokenloom_register_components(self):
        return [ComponentSpec("scheduler", "spf", ShortestPromptFirst, "shortest prompt first")]


def mean_steps_to_finish(llm, prompts, params_list):
    """Engine steps until each request finishes, averaged (deterministic, unlike time)."""
    engine, steps, finished = llm.engine, 0, []
    for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
        engine.add_request(GenerateRequest(f"r{i}", prompt, params))
    while engine.has_unfinished():
        steps += 1
        finished += [steps for d in engine.step() if d.finish_reason is not None]
    return sum(finished) / len(finished)


def main():
    model = write_tiny_model(tempfile.mkdtemp(), "qwen3")
    # Long jobs (long prompt, long answer) arrive before short ones.
    prompts = [[7] * 400] * 8 + [[7] * 8] * 8
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in [48] * 8 + [4] * 8
    ]
    for name in ("continuous", "spf"):
        llm = LLM(
            str(model),
            plugins=[MyPlugin()],
            scheduler=name,
            max_num_seqs=4,
            max_num_batched_tokens=256,
        )
        mean = mean_steps_to_finish(llm, prompts, params)
        print(f"{name:>10}: a request finishes after {mean:.1f} engine steps on average")


if __name__ == "__main__":
    main()

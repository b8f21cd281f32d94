"""``tokenloom bench calibrate``: measure engine steps on the GPU and fit the sim's cost model.

Runs a grid of real steps through the real engine and executor (random weights in
a real shape, the prefix cache off so every prompt token is computed):
- decode: B requests in steady decode at context C (B up to 256, C up to 4096),
  each step's time the gap between consecutive ``engine.step()`` returns (with
  async scheduling, the device's step time once the pipeline is full);
- prefill: N prompts of L tokens in one step, alone (the step from its launch
  to its tokens);
- mixed: a prefill of L tokens joining B decodes at context C, timed over the two
  gaps around it less a steady decode step (``Calibration.mixed`` says why).
Each point is a median over repeats (a mid-run kernel compile is an outlier, not a
sample). The step's features come from the very ``StepInput`` the executor ran
(``sim.cost_model.step_features``); ``sim.cost_model.fit`` fits the coefficients
and reports the error per step class. Writes the cost model JSON (``--out``) and
the measured points beside it (``*-samples.json``), so a fit can be redone.

    tokenloom bench calibrate --model llama-3-8b --out core/sim/data/llama-3-8b.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from tokenloom.bench.common import add_engine_args, engine_options, print_table

GRIDS: dict[str, dict[str, list[tuple[int, ...]]]] = {
    # decode (batch, context); prefill (prompts, length); mixed (batch, context, length)
    "full": {
        "decode": [
            (1, 256),
            (1, 4096),
            (4, 1024),
            (16, 512),
            (16, 2048),
            (32, 1024),
            (64, 512),
            (64, 2048),
            (128, 512),
            (128, 1024),
            (256, 256),
            (256, 512),
        ],
        "prefill": [
            (1, 64),
            (1, 256),
            (1, 1024),
            (1, 2048),
            (1, 4096),
            (1, 8000),
            (4, 512),
            (8, 1024),
            (16, 512),
        ],
        "mixed": [
            (16, 512, 512),
            (16, 512, 4096),
            (64, 1024, 1024),
            (64, 1024, 7000),
            (128, 512, 2048),
        ],
    },  # fmt: skip
    "tiny": {  # for the CPU test: a tiny model, seconds
        "decode": [(1, 16), (2, 32), (4, 16), (8, 8)],
        "prefill": [(1, 16), (1, 48), (2, 32), (3, 16)],
        "mixed": [(2, 16, 24), (4, 8, 40)],
    },
}


class StepTimer:
    """Wraps the engine's executor: remembers the features of every step it is
    given, in order (``submit`` with async scheduling, ``execute`` without)."""

    def __init__(self, engine: Any, sizes: list[int]) -> None:
        from tokenloom.sim.cost_model import step_features

        self.features: list[Any] = []
        executor = engine.executor
        name = "submit" if engine.pipelined else "execute"
        run = getattr(executor, name)

        def timed(step: Any) -> Any:
            self.features.append(step_features(step, sizes))
            return run(step)

        setattr(executor, name, timed)


class Calibration:
    def __init__(self, engine: Any, repeats: int) -> None:
        self.engine = engine
        self.repeats = repeats
        self.top = min(30000, engine.info.vocab_size - 10)
        self.counter = 0
        sizes: list[int] = []
        if engine.config.device == "cuda" and not engine.config.enforce_eager:
            from tokenloom.sim.cost_model import graph_sizes

            sizes = graph_sizes(engine.config.max_num_seqs)
        self.timer = StepTimer(engine, sizes)
        self.samples: list[tuple[Any, float]] = []

    def _add(self, length: int, max_tokens: int) -> None:
        from tokenloom.protocols.requests import GenerateRequest
        from tokenloom.protocols.sampling import SamplingParams

        self.counter += 1
        base = self.counter * 7919
        prompt = [(base + 31 * i) % self.top + 5 for i in range(length)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(GenerateRequest(f"cal-{self.counter}", prompt, params))

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def _timed_steps(self, count: int) -> list[tuple[Any, float]]:
        """Step ``count`` times; each step's gap since the previous return, with the
        features of the step whose output that call folded in."""
        engine, features = self.engine, self.timer.features
        out = []
        last = time.perf_counter()
        for _ in range(count):
            before = len(features)
            engine.step()
            now = time.perf_counter()
            # Pipelined: the call launched one step and folded the one before it.
            folded = before - 1 if engine.pipelined else before
            if 0 <= folded < len(features):
                out.append((features[folded], now - last))
            last = now
        return out

    def decode(self, batch: int, context: int, steps: int = 12) -> None:
        warm = 4
        self._start_decodes(batch, context)
        timed = self._timed_steps(warm + steps)[warm:]
        timed = [(f, t) for f, t in timed if f.step_class == "decode" and f.num_seqs == batch]
        if timed:  # one sample: the median step of the steady run
            self.samples.append(sorted(timed, key=lambda item: item[1])[len(timed) // 2])
        self._abort_all()

    def _start_decodes(self, batch: int, context: int) -> None:
        """``batch`` requests at ``context`` tokens, prefilled, decoding."""
        for _ in range(batch):
            self._add(context, 100_000)
        while self.engine.stats().num_waiting or self._prefilling():
            self.engine.step()

    def _abort_all(self) -> None:
        self.engine.abort([f"cal-{i}" for i in range(1, self.counter + 1)])
        self._drain()

    def _prefilling(self) -> bool:
        return any(f.step_class != "decode" for f in self.timer.features[-2:])

    def prefill(self, prompts: int, length: int) -> None:
        for _ in range(self.repeats):
            self._drain()
            for _ in range(prompts):
                self._add(length, 1)
            started = time.perf_counter()
            before = len(self.timer.features)
            self._drain()
            elapsed = time.perf_counter() - started
            steps = [f for f in self.timer.features[before:] if f.num_tokens]
            if len(steps) == 1:  # one step did all the prompts' work
                self.samples.append((steps[0], elapsed))

    def mixed(self, batch: int, context: int, length: int) -> None:
        """A prefill of ``length`` joining ``batch`` decodes. A single return-to-return
        gap does not time the mixed step: the call that submits it returns late (an
        eager step's launches keep the host busy while the device follows them, or a
        host sync waits), so part of the step runs before that return and the next gap
        holds only the rest (issue 13: 0.8 ms for a 528-token step). The gaps
        of the call that submits it and the call that folds it sum to the decode step
        before it plus the mixed step, wherever the boundary falls; the decode step's
        time (the median of steady decode gaps just before) is subtracted."""
        self._start_decodes(batch, context)
        for _ in range(self.repeats):
            steady = [
                t
                for f, t in self._timed_steps(6)[1:]
                if f.step_class == "decode" and f.num_seqs == batch
            ]
            decode_s = sorted(steady)[len(steady) // 2] if steady else None
            self._add(length, 1)
            timed = self._timed_steps(4)
            for i, (f, t) in enumerate(timed):
                if f.step_class != "mixed":
                    continue
                if not self.engine.pipelined:  # the call ran the step alone
                    self.samples.append((f, t))
                    continue
                before = timed[i - 1][0] if i else None
                if before is None or decode_s is None:
                    continue
                if before.step_class == "decode" and before.num_seqs == batch:
                    self.samples.append((f, timed[i - 1][1] + t - decode_s))
        self._abort_all()


def main(argv: list[str]) -> int:
    from tokenloom.sim.cost_model import H200_BANDWIDTH, fit, implausible

    parser = argparse.ArgumentParser(prog="tokenloom bench calibrate", description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--grid", choices=sorted(GRIDS), default="full")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from tokenloom import LLM

    options = engine_options(args)
    if options.get("num_speculative_tokens") and options.get("proposer", "none") != "none":
        # The cost model has no speculative steps, and with speculation a pipelined
        # engine runs synchronous steps, which the step timing below cannot tell apart.
        parser.error("calibrate measures plain steps: leave out --proposer speculation")
    options["enable_prefix_caching"] = False
    llm = LLM(**options)
    engine = llm.engine
    started = time.perf_counter()
    grid = GRIDS[args.grid]
    cal = Calibration(engine, args.repeats)
    batch, context = grid["decode"][0]
    cal.decode(batch, context, steps=4)  # warm-up: first compiles, graphs
    cal.prefill(*grid["prefill"][0])
    cal.samples.clear()
    for point in grid["decode"]:
        cal.decode(*point)
    for point in grid["prefill"]:
        cal.prefill(*point)
    for point in grid["mixed"]:
        cal.mixed(*point)
    measure_s = time.perf_counter() - started

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    shape = _shape(args.model, engine)
    kwargs: dict[str, Any] = {}
    if torch.cuda.is_available():
        from tokenloom.bench.latency import copy_bandwidth

        kwargs["bandwidth"] = copy_bandwidth()
    source = (
        f"calibrated: tokenloom bench calibrate --grid {args.grid} on {device}, "
        f"{time.strftime('%Y-%m-%d')}, {len(cal.samples)} measured steps"
    )
    bad = implausible(shape, cal.samples, kwargs.get("bandwidth", H200_BANDWIDTH))
    for i in bad:
        print(
            f"dropped: {cal.samples[i][0]} measured {1e3 * cal.samples[i][1]:.2f} ms, "
            "faster than its weight read"
        )
    kept = [row for i, row in enumerate(cal.samples) if i not in set(bad)]
    model = fit(shape, kept, source=source, **kwargs)
    model.device = device
    out = Path(args.out or f"cost-{shape.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    samples_path = out.with_name(out.stem + "-samples.json")
    samples_path.write_text(
        json.dumps([{"features": _builtins(f), "seconds": t} for f, t in cal.samples], indent=0)
    )
    rows: list[tuple[str, Any]] = [("measured steps", len(cal.samples)), ("measure s", measure_s)]
    rows += [(f"coef {k}", f"{v:.4g}") for k, v in model.coefficients.items()]
    for name, err in sorted(model.fit_error.items()):
        rows.append(
            (
                f"fit error {name}",
                f"{err['steps']} steps, mean {100 * err['mean_rel_err']:.1f}%, "
                f"max {100 * err['max_rel_err']:.1f}%",
            )
        )
    print_table(f"calibration: {shape.name} on {device}", rows)
    print(f"wrote {out} and {samples_path}")
    return 0


def _shape(model: str, engine: Any) -> Any:
    from tokenloom.checkpoints.model_shapes import is_shape_name
    from tokenloom.sim.cost_model import ModelShape

    if is_shape_name(model):
        return ModelShape.named(model)
    config = json.loads((Path(engine.config.model) / "config.json").read_text())
    dtype_bytes = 4 if str(engine.info.dtype).endswith("float32") else 2
    return ModelShape.from_hf_config(Path(model).name, config, dtype_bytes)


def _builtins(features: Any) -> dict[str, Any]:
    return {name: getattr(features, name) for name in features.__struct_fields__}


def load_samples(path: str | Path) -> list[tuple[Any, float]]:
    """The measured points a calibration wrote (to refit with other terms or data)."""
    from tokenloom.sim.cost_model import StepFeatures

    rows = json.loads(Path(path).read_text())
    return [(StepFeatures(**row["features"]), row["seconds"]) for row in rows]


def summary_table(samples: list[tuple[Any, float]], model: Any) -> list[dict[str, Any]]:
    """Measured vs predicted per sample, for a report."""
    return [
        {"class": f.step_class, "measured_ms": 1e3 * t, "predicted_ms": 1e3 * model.step_time(f)}
        for f, t in samples
    ]

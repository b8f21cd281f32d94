"""The ``tokenloom`` command: argparse front door, subcommands imported lazily.

``tokenloom --help`` must answer fast, so this module imports only argparse, the
config (msgspec) and nothing heavy; each subcommand imports its implementation when
it runs. ``serve`` gets one flag per EngineConfig field, generated from the fields.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from tokenloom.config import ConfigError, EngineConfig, load_config

BENCHES = ("scheduler", "throughput", "latency", "serve", "calibrate", "host", "allreduce")
SKIPPED_FIELDS = ("plugin",)  # dict-valued: set in the TOML file's [plugin.NAME] tables


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Pass-through commands (bench, tiny-model) parse their own arguments.
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.args = rest
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenloom", description="tokenloom: an LLM inference and serving engine."
    )
    parser.set_defaults(command=None)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    plugins = commands.add_parser("plugins", help="list every registered component")
    plugins.set_defaults(command="plugins", run=_run_plugins)

    serve = commands.add_parser("serve", help="serve a model (OpenAI-compatible HTTP, ZMQ)")
    serve.add_argument("model_dir", nargs="?", help="Hugging Face model directory")
    serve.add_argument("--config", metavar="FILE", help="TOML config file")
    add_config_flags(serve)
    serve.set_defaults(command="serve", run=_run_serve)

    bench = commands.add_parser("bench", help="run a benchmark")
    benches = bench.add_subparsers(title="benchmarks", metavar="BENCH", required=True)
    for name in BENCHES:
        sub = benches.add_parser(
            name, help=f"the {name} benchmark (see its --help)", add_help=False
        )
        sub.set_defaults(command="bench", run=_lazy(f"tokenloom.bench.{name}"), passthrough=True)

    tiny = commands.add_parser(
        "tiny-model", help="write a small random checkpoint (see its --help)", add_help=False
    )
    tiny.set_defaults(
        command="tiny-model", run=_lazy("tokenloom.checkpoints.tiny_models"), passthrough=True
    )

    sim = commands.add_parser(
        "sim",
        help="compare schedulers on a workload with a GPU cost model, on the CPU (see its --help)",
        add_help=False,
    )
    sim.set_defaults(command="sim", run=_lazy("tokenloom.sim.cli"), passthrough=True)

    evaluate = commands.add_parser(
        "eval",
        help="measure a config's quality: perplexity, golden completions (see its --help)",
        add_help=False,
    )
    evaluate.set_defaults(command="eval", run=_lazy("tokenloom.eval.cli"), passthrough=True)

    plan = commands.add_parser(
        "plan",
        help="memory budget: weights, KV blocks, requests at full length (see its --help)",
        add_help=False,
    )
    plan.set_defaults(command="plan", run=_lazy("tokenloom.entrypoints.plan"), passthrough=True)

    quantize = commands.add_parser(
        "quantize",
        help="calibrated (GPTQ) int4 / fp8 weights into a checkpoint (see its --help)",
        add_help=False,
    )
    quantize.set_defaults(
        command="quantize", run=_lazy("tokenloom.entrypoints.quantize"), passthrough=True
    )
    return parser


SHORT_FLAGS = {"tensor_parallel_size": ("-tp",)}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per EngineConfig field: bools as ``--x/--no-x``, lists
    comma-separated. Every default is None, so only given flags override the file."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine config (overrides the config file)")
    for field in EngineConfig.__struct_fields__:
        if field in SKIPPED_FIELDS:
            continue
        flags = ["--" + field.replace("_", "-"), *SHORT_FLAGS.get(field, ())]
        kind = _unwrap_optional(hints[field])
        if kind is bool:
            group.add_argument(*flags, dest=field, action=argparse.BooleanOptionalAction)
        elif typing.get_origin(kind) is list:
            group.add_argument(*flags, dest=field, type=_comma_list, metavar="A,B")
        elif kind in (int, float, str):
            group.add_argument(*flags, dest=field, type=kind, metavar=kind.__name__.upper())
        else:
            raise TypeError(f"no CLI flag for config field {field} of type {kind}")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides: dict[str, Any] = {
        field: getattr(args, field, None)
        for field in EngineConfig.__struct_fields__
        if field not in SKIPPED_FIELDS
    }
    if args.model_dir is not None:
        overrides["model"] = args.model_dir
    return load_config(args.config, **overrides)


def _unwrap_optional(kind: Any) -> Any:
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        members = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return kind


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _lazy(module_name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        module = importlib.import_module(module_name)
        return int(module.main(list(args.args)))

    return run


def _run_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from tokenloom.entrypoints.serve import main as serve_main  # type: ignore[import-not-found, unused-ignore]

    return int(serve_main(config))


def _run_plugins(args: argparse.Namespace) -> int:
    from tokenloom.plugin_manager import PluginError, PluginManager

    try:
        pm = PluginManager.default()
        rows = [(c.kind, c.name, c.origin, c.description) for c in pm.components()]
    except PluginError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    header = ("KIND", "NAME", "ORIGIN", "DESCRIPTION")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        cells = [cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)]
        print("  ".join([*cells, row[3]]).rstrip())
    return 0

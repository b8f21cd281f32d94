"""Fingerprint every Triton kernel a test run launches, compiled for the H100/H200
(sm_90) on a machine without a GPU, so that a change meant to leave the GPU code as it
is can be shown to leave its machine code as it is, with no device time.

    # 1. record: run tests on the CPU (Triton's interpreter) and keep each launch's
    #    specialization: the argument types, Triton's divisibility-by-16 and ==1
    #    specializations, the constexprs and the launch options (warps, stages, ...)
    python scripts/kernel_fingerprint.py record SPECS.pkl -- tests/plugins/attention -q
    # 2. compile: in a process without the interpreter, compile each recorded launch for
    #    sm_90 and hash its SASS (cuobjdump, no addresses or file names in it)
    python scripts/kernel_fingerprint.py compile SPECS.pkl PRINTS.json
    # 3. compare two trees' fingerprints (the same tests run on each)
    python scripts/kernel_fingerprint.py diff BEFORE.json AFTER.json

Run steps 1-2 once per tree: with ``PYTHONPATH`` naming another tree's install (e.g.
``pip install --no-deps --target /tmp/before <extracted tree>``) the same commands
fingerprint that tree. Or all of it in one command, a git revision against the working
tree, each running its own copy of the tests (default ``tests/plugins/attention``):

    python scripts/kernel_fingerprint.py compare REV [-- PYTEST_ARGS]
 ``diff`` lists kernels whose SASS differs, whose registers,
spills or shared memory differ, and launches only one tree made; it exits 1 if any.

What it proves: the same machine code for every specialization the tests launch,
compiled by this machine's Triton (the GPU host's may be another version; both trees
meet the same one here). What it does not: anything about specializations the tests
never launch (production shapes differ in sizes, not usually in divisibility), or host
code around the launches. Timing still needs the GPU."""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import hashlib
import importlib
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
TARGET = ("cuda", 90, 32)
# lines of cuobjdump's listing that name files or sections rather than instructions
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/")  # an instruction's address
SASS_NOISE = re.compile(r"^\s*(Fatbin|code for|\.section|Function :|\s*$)|\.cubin")


def _spec_of(fn: Any, fn_kwargs: dict, args: tuple, kwargs: dict) -> dict:
    """One launch's compile inputs, as Triton's JIT would compute them on an sm_90 GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = JITFunction(fn, **fn_kwargs)
    backend = make_backend(GPUTarget(*TARGET))
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    launch = {k: v for k, v in kwargs.items() if k not in jit.arg_names}
    bound, specialization, _ = binder(
        *args, **{k: v for k, v in kwargs.items() if k in jit.arg_names}
    )
    _, signature, constexprs, attrs = jit._pack_args(backend, {}, bound, specialization, {})
    return {
        "kernel": f"{fn.__module__}:{fn.__qualname__}",
        "signature": signature,
        "constexprs": {k: _plain(v) for k, v in constexprs.items()},  # by argument path
        "constexpr_names": {  # the same, by name (top-level arguments), for reading
            jit.arg_names[k[0]]: _plain(v) for k, v in constexprs.items() if len(k) == 1
        },
        "attrs": attrs,
        "options": {k: _plain(v) for k, v in sorted(launch.items())},
    }


def _plain(value: Any) -> Any:
    """A constexpr or option as something pickle and repr keep stable across trees."""
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, tl.dtype):
        return ("tl.dtype", value.name)
    return value


def _unplain(value: Any) -> Any:
    import triton.language as tl

    if isinstance(value, tuple) and len(value) == 2 and value[0] == "tl.dtype":
        return tl.dtype(value[1])
    return value


def record(out: Path, pytest_args: list[str]) -> int:
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    from triton.runtime.interpreter import InterpretedFunction

    specs: dict[str, dict] = {}
    errors: list[str] = []
    run = InterpretedFunction.run

    def recording_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if not self.fn.__module__.startswith("tokenloom."):  # tests' own kernels
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        try:
            spec = _spec_of(self.fn, self.kwargs, args, kwargs)
            specs.setdefault(_key(spec), spec)
        except Exception as exc:  # noqa: BLE001 - recorded, the launch still runs
            errors.append(f"{self.fn.__module__}:{self.fn.__qualname__}: {exc!r}")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run  # type: ignore[method-assign]
    try:
        code = pytest.main(["-p", "no:cacheprovider", *pytest_args])
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]
    out.write_bytes(pickle.dumps(specs))
    kernels = {s["kernel"] for s in specs.values()}
    print(f"recorded {len(specs)} launch specializations of {len(kernels)} kernels -> {out}")
    for line in sorted(set(errors))[:20]:
        print("not recorded:", line)
    return 0 if code in (0, 1) else int(code)  # failing tests still launched kernels


def _key(spec: dict) -> str:
    body = repr((spec["signature"], sorted(spec["constexprs"].items(), key=repr),
                 sorted(spec["attrs"].items(), key=repr), spec["options"]))  # fmt: skip
    return f"{spec['kernel']}#{hashlib.sha256(body.encode()).hexdigest()[:12]}"


def _sass(cubin: bytes) -> tuple[str, dict[str, int]]:
    """The SASS listing without its file and section lines, and the resource usage
    (registers, local memory: spills and stack, in bytes)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listing, usage = (
            subprocess.run(
                [str(tool), flag, f.name], capture_output=True, text=True, check=True
            ).stdout
            for flag in ("-sass", "-res-usage")
        )
    sass = "\n".join(line for line in listing.splitlines() if not SASS_NOISE.search(line))
    found = dict(re.findall(r"(REG|LOCAL|STACK):(\d+)", usage))
    return sass, {
        "registers": int(found.get("REG", -1)),
        "local_bytes": int(found.get("LOCAL", 0)) + int(found.get("STACK", 0)),
    }


def _error_text(exc: BaseException) -> str:
    """A compile failure as text: the outermost error, then the one it was raised from, and
    so on (Triton's ``CompilationError`` wraps the error at the call site's line in one
    at the callee's; the innermost names what went wrong)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return "\n".join(parts)[-4000:]


def _compile_one(spec: dict) -> dict:
    """One launch compiled for sm_90: its SASS hash and resources, or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, _, qualname = spec["kernel"].partition(":")
    try:
        jit = getattr(importlib.import_module(module), qualname)
        constexprs = {k: _unplain(v) for k, v in spec["constexprs"].items()}
        src = ASTSource(jit, spec["signature"], constexprs, spec["attrs"])
        options = {k: v for k, v in spec["options"].items() if v is not None}
        compiled = triton.compile(src, target=GPUTarget(*TARGET), options=options)
        sass, usage = _sass(compiled.asm["cubin"])
        return {
            "kernel": spec["kernel"],
            "sass_sha256": hashlib.sha256(sass.encode()).hexdigest(),
            "instructions": len(INSTRUCTION.findall(sass)),
            **usage,
            "shared": compiled.metadata.shared,
        }
    except Exception as exc:  # noqa: BLE001 - a kernel this tree cannot compile
        return {"kernel": spec["kernel"], "error": _error_text(exc)}


def compile_all(specs_path: Path, out: Path, jobs: int = 0) -> int:
    """Compile every recorded launch, ``jobs`` processes at once (0: one per core)."""
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("compile: unset TRITON_INTERPRET (the kernels must be Triton's JITFunctions)")
    import triton

    specs = pickle.loads(specs_path.read_bytes())
    keys = sorted(specs)
    workers = jobs or os.cpu_count() or 1
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        results = pool.map(_compile_one, [specs[k] for k in keys], chunksize=4)
        prints = dict(zip(keys, results, strict=True))
    out.write_text(
        json.dumps({"triton": triton.__version__, "target": TARGET, "kernels": prints}, indent=1)
    )
    failed = [k for k, v in prints.items() if "error" in v]
    print(f"compiled {len(prints) - len(failed)} of {len(prints)} for sm_90 -> {out}")
    for key in failed:  # the compiler's message (its last line naming an error), not the
        # traceback or the source excerpt around it
        lines = prints[key]["error"].strip().splitlines() or [""]
        named = [line.strip() for line in lines if re.search(r"\w+(Error|Exception)\b", line)]
        print(f"  failed {key}: {(named or lines)[-1][:300]}")
    return 1 if failed else 0


def _by_name(prints: dict[str, dict]) -> dict[str, dict]:
    """``prints`` keyed by kernel name and specialization, without the module, so that
    a kernel moved to another module meets itself; a name that two modules share keeps
    its module."""
    counts = collections.Counter(key.split(":", 1)[1] for key in prints)
    by_name = {}
    for key, value in prints.items():
        name = key.split(":", 1)[1]
        by_name[name if counts[name] == 1 else key] = {**value, "key": key}
    return by_name


def diff(before_path: Path, after_path: Path) -> int:
    before = _by_name(json.loads(before_path.read_text())["kernels"])
    after = _by_name(json.loads(after_path.read_text())["kernels"])
    moved = [k for k in sorted(before.keys() & after.keys()) if before[k]["key"] != after[k]["key"]]
    for key in moved:
        print(f"moved    {key}: {before[key]['kernel']} -> {after[key]['kernel']}")
    fields = ("sass_sha256", "registers", "local_bytes", "shared", "error")
    changed = [k for k in sorted(before.keys() & after.keys())
               if any(before[k].get(f) != after[k].get(f) for f in fields)]  # fmt: skip
    only = sorted(before.keys() ^ after.keys())
    for key in changed:
        b, a = before[key], after[key]
        what = ", ".join(
            f"{f} {b.get(f)} -> {a.get(f)}" for f in fields[1:] if b.get(f) != a.get(f)
        )
        sass = "differs" if b.get("sass_sha256") != a.get("sass_sha256") else "same"
        print(f"changed  {after[key]['key']}: SASS {sass}" + (f"; {what}" if what else ""))
    for key in only:
        print(f"{'before' if key in before else 'after '} only  {(before | after)[key]['key']}")
    same = len(before.keys() & after.keys()) - len(changed)
    kernels = len({v["kernel"] for v in after.values()})
    print(f"{same} launch specializations identical ({len(moved)} of them moved), {len(changed)} "
          f"changed, {len(only)} in one tree only ({kernels} kernels in the after tree)")  # fmt: skip
    return 1 if changed or only else 0


def compare(rev: str, pytest_args: list[str]) -> int:
    """Fingerprint ``rev`` (extracted and installed into a temporary directory) and the
    working tree, each recording its own tests' launches, then ``diff`` the two."""
    root = Path(__file__).resolve().parents[1]
    work = Path(tempfile.mkdtemp(prefix="fingerprint-"))
    src, pkg = work / "src", work / "pkg"
    src.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=root, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-compile", "--target", str(pkg), str(src)],
        check=True, capture_output=True,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    trees = {"before": (src, {**env, "PYTHONPATH": str(pkg)}), "after": (root, env)}
    compile_failed = False
    for name, (cwd, tree_env) in trees.items():
        for step in (
            ["record", str(work / f"{name}.pkl"), "--", *pytest_args],
            ["compile", str(work / f"{name}.pkl"), str(work / f"{name}.json")],
        ):
            done = subprocess.run(
                [sys.executable, __file__, *step], cwd=cwd, env=tree_env,
                capture_output=True, text=True,
            )  # fmt: skip
            lines = done.stdout.strip().splitlines()
            if step[0] == "compile":  # "compiled N of M", then each failure
                lines = [line for line in lines if line.startswith(("compiled", "  failed"))]
            summary = lines[-1:] if step[0] == "record" else lines
            for line in summary or [done.stderr.strip()[-300:]]:
                print(f"{name} ({rev if name == 'before' else 'working tree'}): {line}")
            if done.returncode != 0 and step[0] == "record":
                print(done.stdout[-2000:], done.stderr[-2000:])
                return 2
            compile_failed |= done.returncode != 0 and step[0] == "compile"
    print(f"files in {work}")
    differs = diff(work / "before.json", work / "after.json")
    if compile_failed:  # a launch that did not compile is no fingerprint: say so last
        print("some launches failed to compile (above): their kernels are not compared")
    return max(differs, int(compile_failed))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run pytest under the interpreter, keep the launches")
    rec.add_argument("specs", type=Path)
    rec.add_argument("pytest_args", nargs=argparse.REMAINDER)
    comp = sub.add_parser("compile", help="compile the recorded launches for sm_90")
    comp.add_argument("specs", type=Path)
    comp.add_argument("out", type=Path)
    comp.add_argument("--jobs", type=int, default=0, help="processes (default: one per core)")
    dif = sub.add_parser("diff", help="compare two trees' fingerprints")
    dif.add_argument("before", type=Path)
    dif.add_argument("after", type=Path)
    cmp = sub.add_parser("compare", help="a git revision against the working tree")
    cmp.add_argument("rev")
    cmp.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.cmd == "compare":
        rest = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
        return compare(args.rev, rest or ["tests/plugins/attention", "-q"])
    if args.cmd == "record":
        rest = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
        return record(args.specs, rest)
    if args.cmd == "compile":
        return compile_all(args.specs, args.out, args.jobs)
    return diff(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())

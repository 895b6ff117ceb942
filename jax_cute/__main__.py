"""``python -m jax_cute cache list|clear|precompile``: manage the kernel cache.

``precompile`` lowers the listed problems for a target arch exactly as a jitted model would
(so the same cache keys are filled), on any machine: no GPU is needed. Each arch compiles in a
process of its own with ``CUTE_DSL_ARCH`` set. Copy the cache directory (``JAX_CUTE_CACHE_DIR``)
to the GPU machines and they only load objects.

Problem syntax:
  --matmul 4096x4096,4096x14336[:bfloat16][:ta][:tb][:grad]   shapes of a and b as for
           jax_cute.matmul (batch dims allowed, e.g. 8x2048x1024,8x1024x1536)
  --ragged M,K,N,G[:bfloat16][:grad]                           lhs [M,K], rhs [G,K,N]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from typing import NoReturn

import jax
import jax.numpy as jnp

import jax_cute
from jax_cute import config
from jax_cute.arch import KNOWN_ARCHES
from jax_cute.cache import CACHE

PROG = "python -m jax_cute"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the command to run for help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("x"))


def _problem(kind: str, text: str):
    """(function, argument shapes, flags) of a --matmul / --ragged problem; ValueError if malformed."""
    parts = text.split(":")
    flags = set(parts[1:])
    dtypes = [f for f in flags if f not in ("ta", "tb", "grad")]
    try:
        dtype = jnp.dtype(dtypes[0]) if dtypes else jnp.dtype(jnp.bfloat16)
        if len(dtypes) > 1:
            raise TypeError
        if kind == "matmul":
            sa, sb = (_shape(s) for s in parts[0].split(","))
        else:
            m, k, n, g = (int(x) for x in parts[0].split(","))
    except (TypeError, ValueError):
        syntax = "AxB,CxD[:dtype][:ta][:tb][:grad]" if kind == "matmul" else "M,K,N,G[:dtype][:grad]"
        raise ValueError(f"--{kind} {text!r}: expected {syntax}") from None
    if kind == "matmul":
        def f(a, b):
            return jax_cute.matmul(a, b, transpose_a="ta" in flags, transpose_b="tb" in flags)
        return f, [jax.ShapeDtypeStruct(sa, dtype), jax.ShapeDtypeStruct(sb, dtype)], flags

    def f(lhs, rhs, gs):
        return jax_cute.ragged_dot(lhs, rhs, gs)
    return f, [jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
               jax.ShapeDtypeStruct((g,), jnp.int32)], flags


def _lower(f, args, flags) -> None:
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    if "grad" in flags:  # the backward GEMMs are kernels of their own
        def grads(*xs):
            return jax.grad(lambda *ys: f(*ys).astype(jnp.float32).sum(), argnums=(0, 1))(*xs)
        jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",))


def _precompile_one(arch: str, matmuls: list[str], raggeds: list[str]) -> int:
    # Strict: a problem no kernel covers is reported, not silently left to XLA. Unverified
    # kernels are allowed: compiling one runs nothing, and each still checks itself on first use.
    config.set(target_arch=arch, strict=True, unverified_kernels=True)
    rc = 0
    for kind, items in (("matmul", matmuls), ("ragged", raggeds)):
        for text in items:
            before = CACHE.stats.compiles
            try:
                _lower(*_problem(kind, text))
            except jax_cute.FallbackError as e:
                print(f"{PROG} cache precompile: {arch} {kind} {text}: no kernel: {e.reason}", file=sys.stderr)
                rc = 1
                continue
            except (ValueError, TypeError) as e:
                print(f"{PROG} cache precompile: {arch} {kind} {text}: {str(e).splitlines()[0]}", file=sys.stderr)
                rc = 1
                continue
            print(f"{arch} {kind} {text}: {CACHE.stats.compiles - before} compiled, "
                  f"{CACHE.stats.disk_hits} from disk so far")
    return rc


def _list() -> int:
    rows = list(CACHE.entries())
    print(f"cache: {CACHE.directory()} ({len(rows)} entries)")
    for r in rows:
        if "problem" in r:
            print(f"{r['key'][:12]}  unreadable entry ({r['problem']}); it will be rebuilt")
            continue
        created = r.get("created")
        when = datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M") if created else "?"
        print(f"{r['key'][:12]}  {r['arch']:8s} {r['bytes']:>9d} B  {when}  {r['name']}")
    total = sum(r["bytes"] for r in rows)
    print(f"total {total} bytes")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="group", metavar="{cache}", parser_class=_Parser)
    cache = sub.add_parser("cache", help="list, clear or fill the kernel cache").add_subparsers(
        dest="cmd", metavar="{list,clear,precompile}", parser_class=_Parser)
    cache.add_parser("list", help="show entries and their sizes")
    cache.add_parser("clear", help="delete every kernel entry (only files the cache itself named)")
    pre = cache.add_parser("precompile", help="compile the kernels listed problems need")
    pre.add_argument("--arch", action="append", required=True, choices=KNOWN_ARCHES,
                     help="target arch (repeatable)")
    pre.add_argument("--matmul", action="append", default=[])
    pre.add_argument("--ragged", action="append", default=[])
    pre.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.group is None:
        parser.error("choose a command: cache")
    if args.cmd is None:
        parser.error("choose a cache command: list, clear or precompile")
    if args.cmd == "list":
        return _list()
    if args.cmd == "clear":
        print(f"removed {CACHE.clear_disk()} entries from {CACHE.directory()}")
        return 0
    if not args.matmul and not args.ragged:
        parser.error("cache precompile: name at least one --matmul or --ragged problem")
    for kind, items in (("matmul", args.matmul), ("ragged", args.ragged)):
        for text in items:
            try:
                _problem(kind, text)
            except ValueError as e:
                parser.error(str(e))
    if args.in_process:
        return _precompile_one(args.arch[0], args.matmul, args.ragged)
    rc = 0
    for arch in args.arch:  # one process per arch: the DSL fixes its target per process
        cmd = [sys.executable, "-m", "jax_cute", "cache", "precompile", "--in-process", "--arch", arch]
        for m in args.matmul:
            cmd += ["--matmul", m]
        for r in args.ragged:
            cmd += ["--ragged", r]
        rc |= subprocess.run(cmd, env=dict(os.environ, CUTE_DSL_ARCH=arch, JAX_PLATFORMS="cpu")).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())

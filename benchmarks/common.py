"""One timing method for every implementation in every suite.

``measure`` jits each implementation, warms it up, then runs interleaved rounds: in each round
it times every implementation on the same fresh random inputs (never zeros: zero data can make
hardware draw less power and run faster), each as N back-to-back calls ended by one
``block_until_ready``. Round r starts with implementation r (mod their number), after one
untimed call, so the clock's ramp after the idle gap between rounds does not always fall on the
same implementation; the others follow in a seeded random order, so that no implementation is
always timed right after the same neighbour (see round_order). With ``chain=C`` one call runs
the implementation on C independent input sets inside one jit, as a model's jitted step would:
products of a few tens of microseconds are then timed on the device rather than by the host's
per-call dispatch, and no product finds its inputs in L2 from the previous call. The result per implementation is the median over rounds,
so slow drift (clocks, temperature) hits all implementations alike. A failing implementation
(a rival that cannot compile a shape, an import missing on this jax) becomes a record with
``error`` set, never a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import re
import signal
import statistics
import sys
import time
import traceback
from typing import Callable, ContextManager, Iterator, Sequence
from unittest import mock

import jax
import numpy as np

from jax_cute import autotune


@dataclasses.dataclass
class Impl:
    name: str                 # "jax_cute", "xla", "pallas", ...
    fn: Callable              # a function of the case's arguments (jitted here)
    config: str | None = None  # e.g. a Pallas tuning config; several configs may share a name
    # entered around the first call, where jit traces and lowers (e.g. a jax_cute.config.override)
    context: Callable[[], ContextManager] | None = None


def _block(x) -> None:
    jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def uses_kernel(fn: Callable, args: Sequence) -> bool | None:
    """Whether ``fn`` lowers to our custom call here (None when lowering itself fails)."""
    try:
        lowered = jax.jit(fn).lower(*args)
        text = lowered.as_text()
        if "jax_cute_launch" not in text and "CustomSPMDPartitioning" in text:
            text = lowered.compile().as_text()  # sharded calls become kernels when partitioned
        return "jax_cute_launch" in text
    except Exception:  # noqa: BLE001 - reported as unknown
        return None


def round_order(items: Sequence, r: int, shuffle: bool = False) -> list:
    """``items`` rotated so that round ``r`` starts with item ``r`` (mod their number); with
    ``shuffle`` the rest follow in an order seeded by ``r`` (jax_cute.autotune.round_order, whose
    notes say why). Records keep each round's predecessor (``rounds_after``)."""
    if shuffle:
        return autotune.round_order(items, r)
    k = r % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def _chained(fn: Callable) -> Callable:
    """``fn`` applied to each of several argument tuples, in one program."""
    return lambda *arg_sets: [fn(*a) for a in arg_sets]


def _rel_err(out, ref) -> float:
    o = np.asarray(jax.tree.leaves(out)[0], np.float32)
    r = np.asarray(jax.tree.leaves(ref)[0], np.float32)
    return float(np.max(np.abs(o - r)) / max(float(np.max(np.abs(r))), 1e-30))


def measure(suite: str, table: str, case: str, impls: Sequence[Impl], make_args: Callable[[int], tuple],
            flops: float, *, rounds: int = 7, warmup: int = 2, target_s: float = 0.05,
            meta: dict | None = None, check: bool = True, chain: int = 1, shuffle: bool = True) -> list[dict]:
    """Time ``impls`` on ``make_args(seed)`` as described above; one record per implementation.

    ``flops`` gives TFLOP/s (0 for cases where only time matters). With ``check`` each output
    is compared with the first working implementation's on the same inputs (``max_rel_err``).
    ``chain`` > 1 times each call as ``chain`` independent products in one jit (``ms`` is per
    product). ``shuffle`` (default): see round_order; False gives the plain rotation.
    """
    if CASES is not None and not CASES.search(case):
        return []
    base = {"suite": suite, "table": table, "case": case, "flops": flops, "chain": chain, **(meta or {})}
    records: dict[int, dict] = {}
    jitted: dict[int, Callable] = {}
    if chain > 1:
        impls = [dataclasses.replace(im, fn=_chained(im.fn)) for im in impls]
        one_set = make_args
        make_args = lambda seed: tuple(one_set(seed * chain + j) for j in range(chain))  # noqa: E731
    args = make_args(0)
    ref_out = None
    for i, im in enumerate(impls):
        rec = {**base, "impl": im.name, "config": im.config, "ms": None, "tflops": None, "error": None}
        records[i] = rec
        out = None
        try:
            f = jax.jit(im.fn)
            with (im.context or contextlib.nullcontext)():
                out = f(*args)
            _block(out)
            for _ in range(warmup - 1):
                _block(f(*args))
            t0 = time.perf_counter()
            _block(f(*args))
            cap = 100 * max(1, round(target_s / 0.05))   # (up to 100 calls per 50 ms of window)
            rec["calls"] = int(max(1, min(cap, target_s / max(time.perf_counter() - t0, 1e-6))))
            if im.name == "jax_cute":
                rec["kernel"] = uses_kernel(im.fn, args)  # False: it ran XLA's fallback, say so
            if check:
                if ref_out is None:
                    ref_out = out
                else:
                    rec["max_rel_err"] = _rel_err(out, ref_out)
            jitted[i] = f
        except Exception as e:  # noqa: BLE001 - a failing rival is a result, not a crash
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            print(f"  [{case}] {im.name}{' ' + im.config if im.config else ''} failed: {rec['error']}",
                  file=sys.stderr)
            if "--traceback" in sys.argv:
                traceback.print_exc()
        out = None  # free the output before the next implementation runs
    times: dict[int, list[float]] = {i: [] for i in jitted}
    after: dict[int, list[str | None]] = {i: [] for i in jitted}   # who ran just before, per round
    order = list(jitted)
    for r in range(rounds):
        args = make_args(r + 1)
        _block(args)
        # Each round starts with a different implementation, after one untimed call: the GPU's
        # clock ramps up again after the idle gap while inputs are made, and a fixed order
        # would hand that slow start to the same implementation every round.
        turn = round_order(order, r, shuffle)
        if turn:
            try:
                _block(jitted[turn[0]](*args))
            except Exception:  # noqa: BLE001 - reported by its timed call below
                pass
        for pos, i in enumerate(turn):
            f = jitted[i]
            n = records[i]["calls"]
            try:
                t0 = time.perf_counter()
                for _ in range(n):
                    out = f(*args)
                _block(out)
                times[i].append((time.perf_counter() - t0) / (n * chain) * 1e3)
                prev = impls[turn[pos - 1]] if pos else None
                after[i].append(None if prev is None else prev.name + (f" {prev.config}" if prev.config else ""))
            except Exception as e:  # noqa: BLE001
                records[i]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        del args
    for i, ts in times.items():
        rec = records[i]
        if rec["error"] or not ts:
            continue
        rec["rounds_ms"] = ts
        rec["rounds_after"] = after[i]
        rec["ms"] = statistics.median(ts)
        rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12 if flops else None
        print(f"  [{case}] {rec['impl']:9s}{' ' + rec['config'] if rec['config'] else ''}: {rec['ms']:.4f} ms"
              + (f", {rec['tflops']:.1f} TFLOP/s" if rec["tflops"] else "")
              + (f", rel err {rec['max_rel_err']:.1e}" if rec.get("max_rel_err") is not None else ""))
    MEASURED.extend(records.values())
    return list(records.values())


# every record measure() has returned in this process: what a suite stopped at its time limit
# still writes (suite_main)
MEASURED: list[dict] = []
CASES: re.Pattern | None = None   # suite_main's --cases: measure only the cases it matches


class _Stopped(BaseException):
    """SIGTERM (run.py's --time-limit) inside a suite: a BaseException, so that measure() does
    not take it for a failing implementation."""


@contextlib.contextmanager
def forced_configs(families: Sequence, applies: Callable[[object], bool], **fields) -> Iterator[None]:
    """Trace with ``fields`` replaced in the configs the kernel ``families``' heuristics pick for
    the specs ``applies`` accepts (a variant of the heuristic's kernel, timed beside it)."""
    def forced(heuristic):
        def pick(spec, *args, **kwargs):
            cfg = heuristic(spec, *args, **kwargs)
            return dataclasses.replace(cfg, **fields) if applies(spec) else cfg
        return pick

    with contextlib.ExitStack() as stack:
        for fam in families:
            stack.enter_context(mock.patch.object(fam, "heuristic", forced(fam.heuristic)))
        yield


def best_of(records: list[dict], impl: str) -> list[dict]:
    """Keep, per case, only the fastest working record of ``impl`` (best of its configs);
    if none worked, keep one error record so the report can say it failed."""
    out, groups = [], {}
    for r in records:
        if r["impl"] == impl:
            groups.setdefault((r["table"], r["case"]), []).append(r)
        else:
            out.append(r)
    for rs in groups.values():
        ok = [r for r in rs if r["ms"] is not None]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            best["configs_tried"] = len(rs)
            out.append(best)
        else:
            rs[0]["error"] = "; ".join(sorted({str(r['error']) for r in rs}))[:600]
            rs[0]["configs_tried"] = len(rs)
            out.append(rs[0])
    return out


def gpt_train_cases(gpt, smoke: bool, sizes: tuple[str, ...] = ("h200",)) -> Iterator[tuple]:
    """The GPT example's (``gpt``, examples/gpt_training.py) training cases, dense then MoE, at each
    of its ``sizes`` (tiny once with ``smoke``): (moe, cfg, tx, make_args for measure, case label)."""
    for size, moe in itertools.product(("tiny",) if smoke else sizes, (False, True)):
        cfg = dataclasses.replace(gpt.SIZES[size], moe=moe)
        params, opt_state, tx = gpt.init_train_state(jax.random.key(0), cfg)
        data = gpt.batches(jax.random.key(1), cfg)
        ffn = f"MoE top-{cfg.top_k} of {cfg.experts}" if moe else "dense MLP"
        case = (f"GPT train step, d_model {cfg.d_model}, {cfg.heads} heads, {cfg.layers} layers, {ffn}, "
                f"{cfg.batch}x{cfg.seq} tokens, vocab {cfg.vocab}")
        yield moe, cfg, tx, (lambda s, p=params, o=opt_state, d=data: (p, o, d[s % len(d)])), case


def suite_main(run: Callable[[argparse.Namespace], list[dict]], description: str) -> None:
    """Command line shared by the bench_*.py files: ``--records PATH`` writes the record list."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--records", help="write the records here as JSON (run.py reads them)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, a few rounds: checks the script, not speed")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per case (median is reported)")
    p.add_argument("--cases", metavar="REGEX", help="measure only the cases whose label this matches (re.search)")
    args = p.parse_args()
    global CASES
    CASES = re.compile(args.cases) if args.cases else None

    def stop(*_):
        raise _Stopped()

    signal.signal(signal.SIGTERM, stop)
    try:
        recs = run(args)
    except _Stopped:
        # the cases measured so far, rivals' configs reduced to their best as the suites do
        recs = best_of(MEASURED, "pallas")
        print(f"stopped (SIGTERM) after {len(recs)} records", file=sys.stderr)
    if args.records:
        dev = jax.devices()[0]
        with open(args.records, "w") as f:
            json.dump({"device": dev.device_kind, "backend": jax.default_backend(), "device_count": jax.device_count(),
                       "jax_version": jax.__version__, "records": recs}, f, indent=1, default=str)
    print(f"{len(recs)} records, {sum(r['error'] is not None for r in recs)} failed")

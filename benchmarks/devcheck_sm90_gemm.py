"""Check and time the sm90_gemm family on a Hopper GPU.

  python benchmarks/devcheck_sm90_gemm.py build --out DIR   # CPU machine with the DSL: compile
  python benchmarks/devcheck_sm90_gemm.py run --bins DIR    # GPU machine: load, check, time

`build` compiles the configs the check needs (several dtypes / major-ness / clusters / split-K,
plus the heuristic's pick for each benchmark shape) and writes DIR/<name>.{o,json} and
DIR/index.json. `run` never imports the DSL compiler: it loads the objects and launches them
through jax_cute.launch.kernel_call.

Correctness: fresh random data against a float64 reference (gemm_spec.reference_gemm),
tolerance on max|err| / max|ref|: 1e-2 for bf16 output, 5e-3 for fp16, 1e-3 for fp32; exact
(bit-equal after rounding the reference to the output dtype) on small-integer inputs. Inputs
have NaN in their row padding (a read outside the logical operand poisons the result); outputs
start NaN-filled (config.nan_fill) and must hold no NaN inside C and only NaN in its padding
(every problem is reported: NaN left, padding written, error). Experimental configs (pingpong,
2x2 clusters) are checked in their own children and timed only if they pass.

Timing: per benchmark shape, XLA and every built config are sampled in turn (7 rounds of ~60 ms
of async launches each, median), so clock/power drift hits all alike (the H200 is power-bound:
see the power probe at the end). `run` lists every failure again at the end and exits non-zero
on any. Everything `run` does is decided by `build` (index.json), so the device command stays
`python3 benchmarks/devcheck_sm90_gemm.py run --bins DIR` (~3 min); `build --no-sweep` times
only the heuristic's picks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_cute.kernels import build, sm90_gemm  # noqa: E402  (neither imports the DSL compiler)
from jax_cute.kernels.gemm_spec import GemmSpec, reference_gemm  # noqa: E402
from common import parse_shapes, round_order  # noqa: E402  (benchmarks/common.py, beside this script)

BENCH_SHAPES = [(8192, 8192, 8192), (4096, 14336, 4096), (4096, 4096, 4096), (2048, 2048, 2048),
                (4096, 4096, 14336), (16384, 2048, 2048), (512, 8192, 8192), (16384, 1536, 1024)]
BF = "bfloat16"
C = sm90_gemm.Config

# (name, spec, config) compiled for the correctness sweep
CHECKS = [
    ("c_bf16_kkn_bf16_main", GemmSpec(BF, BF, BF, "k", "k", "n"), C()),
    ("c_bf16_kkn_f32_main", GemmSpec(BF, BF, "float32", "k", "k", "n"), C()),
    ("c_bf16_knn_bf16_rn", GemmSpec(BF, BF, BF, "k", "n", "n"), C(raster="n")),
    ("c_f16_mnm_f16_t128c12", GemmSpec("float16", "float16", "float16", "m", "n", "m"), C(128, 128, 1, 2)),
    ("c_bf16_mkn_bf16_t128c21", GemmSpec(BF, BF, BF, "m", "k", "n"), C(128, 128, 2, 1)),
    ("c_bf16_knm_f32_main", GemmSpec(BF, BF, "float32", "k", "n", "m"), C()),
    ("c_f16_kkn_bf16_t128c11", GemmSpec("float16", "float16", BF, "k", "k", "n"), C(128, 128, 1, 1)),
    ("c_bf16_kkn_bf16_sk2", GemmSpec(BF, BF, BF, "k", "k", "n"), C(split_k=2)),
    ("c_bf16_knn_bf16_pdl", GemmSpec(BF, BF, BF, "k", "n", "n"), C(pdl=True)),
    ("c_bf16_mnm_f32_sk4", GemmSpec(BF, BF, "float32", "m", "n", "m"), C(128, 128, 1, 2, split_k=4)),
    ("c_f16_knn_f16_sk4", GemmSpec("float16", "float16", "float16", "k", "n", "n"), C(128, 256, 1, 2, split_k=4)),
    # 64-wide epilogue subtiles (the heuristic's pick for 16-bit outputs since session 6)
    ("c_bf16_knn_bf16_e64", GemmSpec(BF, BF, BF, "k", "n", "n"), C(epi_n=64)),
    ("c_f16_mkm_f16_e64sk2", GemmSpec("float16", "float16", "float16", "m", "k", "m"), C(split_k=2, epi_n=64)),
    # deferred epilogue (session 7): each tile stored under the next tile's first 1-3 k-tiles
    ("c_bf16_knn_bf16_e64df2", GemmSpec(BF, BF, BF, "k", "n", "n"), C(epi_n=64, defer=2)),
    ("c_f16_mkm_f16_df1", GemmSpec("float16", "float16", "float16", "m", "k", "m"), C(defer=1)),
    ("c_bf16_knm_f16_t128c12df3", GemmSpec(BF, BF, "float16", "k", "n", "m"), C(128, 128, 1, 2, defer=3)),
    # whole-share epilogue (session 10): every subtile of a warpgroup's share staged at once
    ("c_bf16_knn_bf16_e64wc", GemmSpec(BF, BF, BF, "k", "n", "n"), C(epi_n=64, whole_c=True)),
    ("c_f16_mkm_f16_wc", GemmSpec("float16", "float16", "float16", "m", "k", "m"), C(whole_c=True)),
    ("c_bf16_mnm_f32_t128c12wc", GemmSpec(BF, BF, "float32", "m", "n", "m"), C(128, 128, 1, 2, whole_c=True)),
    ("c_bf16_knn_bf16_e64wcdf2", GemmSpec(BF, BF, BF, "k", "n", "n"), C(epi_n=64, whole_c=True, defer=2)),
    ("c_f16_mkm_f16_e64wcdf1", GemmSpec("float16", "float16", "float16", "m", "k", "m"), C(epi_n=64, whole_c=True, defer=1)),
    ("c_bf16_kkn_bf16_e64wcsk2", GemmSpec(BF, BF, BF, "k", "k", "n"), C(split_k=2, epi_n=64, whole_c=True)),
    # experimental (checked in their own children, timed only if they pass): pingpong (each
    # consumer warpgroup owns whole 64-row tiles), 2x2 clusters (A and B both multicast) and
    # 160- or 192-wide tiles
    ("c_bf16_kkn_bf16_pp", GemmSpec(BF, BF, BF, "k", "k", "n"), C(64, 256, 2, 1, raster="n", pingpong=True)),
    ("c_f16_mnm_f32_pp12", GemmSpec("float16", "float16", "float32", "m", "n", "m"), C(64, 128, 1, 2, pingpong=True)),
    ("c_bf16_knn_bf16_pp11", GemmSpec(BF, BF, BF, "k", "n", "n"), C(64, 256, 1, 1, pingpong=True)),
    ("c_bf16_kkn_f32_pp", GemmSpec(BF, BF, "float32", "k", "k", "n"), C(64, 256, 2, 1, raster="n", pingpong=True)),
    ("c_bf16_knn_bf16_pprm", GemmSpec(BF, BF, BF, "k", "n", "n"), C(64, 256, 2, 1, pingpong=True)),
    ("c_bf16_kkn_bf16_c22", GemmSpec(BF, BF, BF, "k", "k", "n"), C(128, 256, 2, 2)),
    # (160 with N-major B takes 64-byte swizzle atoms; 5- and 3-deep epilogue rings)
    ("c_bf16_knn_bf16_t160", GemmSpec(BF, BF, BF, "k", "n", "n"), C(128, 160, raster="n", group=16)),
    ("c_bf16_kkn_f32_t160", GemmSpec(BF, BF, "float32", "k", "k", "n"), C(128, 160)),
    ("c_f16_mnm_f16_t160c12", GemmSpec("float16", "float16", "float16", "m", "n", "m"), C(128, 160, 1, 2)),
    ("c_bf16_knn_bf16_t192", GemmSpec(BF, BF, BF, "k", "n", "n"), C(128, 192, raster="n", group=16)),
    ("c_bf16_mkn_f32_t192c12", GemmSpec(BF, BF, "float32", "m", "k", "n"), C(128, 192, 1, 2)),
    ("c_f16_mnm_f32_c22sk2", GemmSpec("float16", "float16", "float32", "m", "n", "m"), C(128, 128, 2, 2, split_k=2)),
    # 128-row pingpong tiles (session 6)
    ("c_bf16_knn_bf16_pp128x160", GemmSpec(BF, BF, BF, "k", "n", "n"), C(128, 160, pingpong=True)),
    ("c_bf16_kkn_bf16_pp128x160c12", GemmSpec(BF, BF, BF, "k", "k", "n"), C(128, 160, 1, 2, pingpong=True)),
    ("c_f16_mnm_f32_pp128", GemmSpec("float16", "float16", "float32", "m", "n", "m"), C(128, 128, pingpong=True)),
    ("c_bf16_knm_bf16_pp128e64", GemmSpec(BF, BF, BF, "k", "n", "m"), C(128, 128, 1, 1, pingpong=True, epi_n=64)),
    ("c_bf16_knn_bf16_pp128e64wc", GemmSpec(BF, BF, BF, "k", "n", "n"), C(128, 128, 2, 1, pingpong=True, epi_n=64,
                                                                          whole_c=True)),
]


def experimental(cfg) -> bool:
    # (64-wide epilogue subtiles are the heuristic's default since session 6: main checks)
    return bool(cfg.pingpong) or (cfg.cluster_m, cfg.cluster_n) == (2, 2) or cfg.tile_n in (160, 192)

# (M, N, K, L, which operand is broadcast over L: None/"a"/"b"). The first four also run on
# small integers (exact). Odd extents put C's contiguous edge off a 16-byte boundary (TMA
# stores would write the padding behind it); an odd K puts A's/B's k edge there (NaN padding).
PROBLEMS = [(1000, 1032, 776, 1, None), (264, 136, 72, 1, None), (1001, 1003, 520, 3, "a"),
            (300, 260, 1000, 2, "b"), (136, 1001, 1003, 1, None), (1001, 136, 520, 2, None),
            (8, 16, 8, 1, None), (128, 256, 64, 1, None), (520, 2056, 4096, 1, None),
            (2056, 4104, 264, 1, None)]   # 2-5 tiles per CTA: tiles follow tiles (deferred epilogue)
N_INT = 5

# Bench sweep: every benchmark shape runs the heuristic's pick and these alternatives, per
# operand form. Sessions 1-2 swept cluster shape, band width and pingpong rasters; sessions 4-5
# pingpong, PDL, rasters and 160/192-wide cooperative tiles; session 6 64-wide epilogue
# subtiles and pingpong with 128-row tiles per warpgroup; session 7 the deferred epilogue
# (docs/kernel-run-notes.md).
# Session 9: 32- vs 64-wide subtiles after each mainloop, and the deferred epilogue (its
# stages now handed back early, sm90_mainloop).
# Session 10: the whole-share epilogue (3 A/B stages, no store waits inside a tile) against
# session 6's and session 7's picks.
SWEEP = [C(epi_n=64), C(defer=2), C(epi_n=64, whole_c=True)]
THIN_EXTRA = [C(128, 256, 1, 2, raster="n")]   # 512x8192x8192 (one wave of 128 tiles)
# Shapes with few tiles or a short K also try smaller tiles.
SMALL_EXTRA = [C(128, 128, 2, 1), C(128, 128, 2, 1, raster="n")]
# Products under this many FLOPs take a few tens of microseconds: one call per dispatch would
# time the host, so they are timed as CHAIN products (independent A, B pairs) inside one jit.
CHAIN_BELOW_FLOPS = 2e11
CHAIN = 8


def bench_specs():
    # jnp.matmul(a[M,K], b[K,N]) is a k-major, b n-major, c n-major; also the (N,K) weight form
    return {"kn": GemmSpec(BF, BF, BF, "k", "n", "n"), "kk": GemmSpec(BF, BF, BF, "k", "k", "n")}


def label(entry: dict) -> str:
    """How reports name a built config: its key, or the entry's own label (objects built from
    another commit ride along in an index under a label such as "old:<key>")."""
    return entry.get("label") or sm90_gemm.Config(**entry["config"]).key()


def _pname(tag, cfg):
    return f"p_{tag}_{cfg.key().replace('.', '_')}"


def cmd_build(out: str, sweep: bool = True, tags: list[str] | None = None, checks: list[str] | None = None,
              shapes: list[tuple[int, int, int]] | None = None, old: str | None = None,
              old_configs: list[str] | None = None) -> None:
    """Compile the check configs and, per benchmark shape and operand form, the heuristic's pick
    and the sweep. tags/checks/shapes narrow the build (checks: substrings of check names).
    old: a bins directory built from an earlier commit; its objects for the same shapes ride
    along (those whose names hold one of old_configs, default all), renamed old_* and labelled
    "old:<key>", so one GPU run times both commits."""
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):       # stale objects would ride along in the carry
        if f.endswith((".o", ".json")):
            os.remove(os.path.join(out, f))
    index = []
    built = set()

    def add(name, spec, cfg, purpose):
        if name in built:
            return
        t = time.time()
        binary = build.compile_launcher(sm90_gemm.launcher(spec, cfg), sm90_gemm.signature(spec, cfg),
                                        arch=sm90_gemm.ARCH, name=name)
        build.save_binary(binary, os.path.join(out, name))
        index.append({"name": name, "spec": dataclasses.asdict(spec), "config": dataclasses.asdict(cfg),
                      "purpose": purpose})
        built.add(name)
        print(f"  built {name:42s} {cfg.key():32s} {time.time() - t:5.1f}s", flush=True)

    for name, spec, cfg in CHECKS:
        if checks is None or any(c in name for c in checks):
            add(name, spec, cfg, "check")
    old_index = json.load(open(os.path.join(old, "index.json"))) if old else []
    for tag, spec in bench_specs().items():
        if tags is not None and tag not in tags:
            continue
        for (m, n, k) in shapes or BENCH_SHAPES:
            pick = sm90_gemm.heuristic(spec, m, n, k, 1)
            print(f"heuristic {tag} {m}x{n}x{k}: {pick.key()}")
            cfgs = [pick] + ([c for c in SWEEP if c != pick] if sweep else [])
            if sweep and (m, n, k) == (512, 8192, 8192):
                cfgs += [c for c in THIN_EXTRA if c != pick]
            if sweep and (m, n, k) in ((2048, 2048, 2048), (16384, 1536, 1024)):
                cfgs += [c for c in SMALL_EXTRA if c != pick]
            for cfg in cfgs:
                add(_pname(tag, cfg), spec, cfg, "perf")
            names = [_pname(tag, c) for c in cfgs]
            for e in old_index:
                if e["purpose"] == "bench" and e["tag"] == tag and tuple(e["shape"]) == (m, n, k):
                    for name in e["configs"]:
                        if old_configs is not None and not any(c in name for c in old_configs):
                            continue
                        if "old_" + name not in built:
                            src = next(x for x in old_index if x["name"] == name)
                            for ext in (".o", ".json"):
                                shutil.copy(os.path.join(old, name + ext), os.path.join(out, "old_" + name + ext))
                            index.append({**src, "name": "old_" + name, "label": "old:" + label(src)})
                            built.add("old_" + name)
                        names.append("old_" + name)
            index.append({"name": "bench", "purpose": "bench", "tag": tag, "shape": [m, n, k],
                          "pick": _pname(tag, pick), "configs": names})
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
    print(f"wrote {len(index)} entries to {out}/index.json")


# --------------------------------------------------------------------------------- GPU side

def _ld(extent: int, item: int, pad: int) -> int:
    """Leading dimension: 16-byte multiple, plus `pad` extra elements to exercise strides."""
    q = 16 // item
    return -(-extent // q) * q + pad


def _physical(logical, major_mode: int, np_dtype, pad: int, fill=float("nan")):
    """Lay a logical (R, S, L) array out with mode `major_mode` contiguous; returns
    (physical array (L, outer, ld), shape, stride) with NaN in the padding."""
    import numpy as np
    r, s, l = logical.shape
    inner, outer = (s, r) if major_mode == 1 else (r, s)
    ld = _ld(inner, np.dtype(np_dtype).itemsize, pad)
    phys = np.full((l, outer, ld), fill, np.float32)
    view = logical.transpose(2, 0, 1) if major_mode == 1 else logical.transpose(2, 1, 0)
    phys[:, :, :inner] = view
    stride = (ld, 1, outer * ld) if major_mode == 1 else (1, ld, outer * ld)
    return phys.astype(np_dtype), (r, s, l), stride


def _logical_out(phys, shape, major_mode: int):
    m, n, l = shape
    if major_mode == 1:
        return phys[:, :, :n].transpose(1, 2, 0), phys[:, :, n:]
    return phys[:, :, :m].transpose(2, 1, 0), phys[:, :, m:]


def _np_dtype(name):
    import jax.numpy as jnp
    return {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}[name]


def _make_call(binary, spec: GemmSpec, cfg: sm90_gemm.Config, m, n, k, l, a_shape_stride, b_shape_stride,
               c_phys_shape, c_shape, c_stride):
    import jax
    import jax.numpy as jnp
    from jax_cute.launch import kernel_call

    outs = {"c": (jax.ShapeDtypeStruct(c_phys_shape, _np_dtype(spec.c_dtype)), c_shape, c_stride)}
    zeroed = []
    for ws in sm90_gemm.workspace(spec, cfg, m, n, k, l):
        elems = ws.nbytes // 4
        dt = jnp.float32 if ws.name == "splitk_partials" else jnp.int32
        outs[ws.name] = (jax.ShapeDtypeStruct((elems,), dt), (elems,), (1,))
        if ws.zeroed:
            zeroed.append(ws.name)

    def f(a, b):
        res = kernel_call(binary, inputs={"a": (a, *a_shape_stride), "b": (b, *b_shape_stride)},
                          outputs=outs, zeroed=zeroed)
        return res["c"]
    return jax.jit(f)


def check_one(binary, spec: GemmSpec, cfg, prob, rng, integer: bool) -> tuple[bool, str]:
    import jax
    import numpy as np
    from jax_cute import config

    m, n, k, l, bcast = prob
    la, lb = (1 if bcast == "a" else l), (1 if bcast == "b" else l)
    in_dt = _np_dtype(spec.a_dtype)
    if integer:
        a = rng.integers(-3, 4, (m, k, la)).astype(np.float32)
        b = rng.integers(-3, 4, (n, k, lb)).astype(np.float32)
    else:
        a = rng.standard_normal((m, k, la), np.float32)
        b = rng.standard_normal((n, k, lb), np.float32)
    a = a.astype(in_dt).astype(np.float32)   # what the kernel sees
    b = b.astype(in_dt).astype(np.float32)
    pa, sa, ta = _physical(a, 1 if spec.a_major == "k" else 0, in_dt, pad=8)
    pb, sb, tb = _physical(b, 1 if spec.b_major == "k" else 0, in_dt, pad=0)
    c_mode = 1 if spec.c_major == "n" else 0
    out_dt = _np_dtype(spec.c_dtype)
    c_ld = _ld(n if c_mode else m, np.dtype(out_dt).itemsize, 8)
    c_phys_shape = (l, m, c_ld) if c_mode else (l, n, c_ld)
    c_stride = (c_ld, 1, m * c_ld) if c_mode else (1, c_ld, n * c_ld)
    with config.override(nan_fill=True):
        f = _make_call(binary, spec, cfg, m, n, k, l, (sa, ta), (sb, tb), c_phys_shape, (m, n, l), c_stride)
        out = np.asarray(jax.block_until_ready(f(jax.numpy.asarray(pa), jax.numpy.asarray(pb)))).astype(np.float32)
    got, pad = _logical_out(out, (m, n, l), c_mode)
    ref = reference_gemm(np.broadcast_to(a, (m, k, l)), np.broadcast_to(b, (n, k, l)))
    problems = []
    n_nan = int(np.isnan(got).sum())
    if n_nan:
        problems.append(f"{n_nan} NaN left in C")
    if pad.size and not np.isnan(pad).all():
        hit = ~np.isnan(pad)
        cols = np.nonzero(hit.any(axis=(0, 1)))[0]
        problems.append(f"wrote into C's padding ({int(hit.sum())} elems, batches "
                        f"{sorted(set(np.nonzero(hit.any(axis=(1, 2)))[0].tolist()))}, pad cols "
                        f"{cols.min()}..{cols.max()} of {pad.shape[2]})")
    fin = np.isfinite(got)
    if integer:
        want = ref.astype(out_dt).astype(np.float32)
        bad = int((got != want).sum())
        if bad:
            problems.append(f"exact: {bad} mismatches")
        detail = f"exact: {bad} mismatches"
    else:
        tol = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 1e-3}[spec.c_dtype]
        diff = np.where(fin, np.abs(got - ref), np.inf)
        err = float(diff.max() / max(np.abs(ref).max(), 1e-30))
        if not err <= tol:
            problems.append(f"rel err {err:.2e} > tol {tol:.0e}")
        detail = f"rel err {err:.2e} (tol {tol:.0e})"
    return (not problems), ("; ".join(problems) if problems else detail)


def _sample(fn, args, reps) -> float:
    import jax
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps


def _time_interleaved(fns, args, rounds=7, window=0.06) -> list[float]:
    """Median time per call of each function, sampled in turn (A B C, B C A, ...) so that clock
    and power drift hit all of them alike; each sample is ~`window` s of async launches."""
    import jax
    reps = []
    for fn in fns:
        jax.block_until_ready(fn(*args))
        t = _sample(fn, args, 3)
        reps.append(max(5, min(400, int(window / max(t, 1e-6)))))
    samples = [[] for _ in fns]
    for r in range(rounds):
        # rotate who goes first (after one untimed call) so no config always gets the round's start
        turn = round_order(range(len(fns)), r)
        jax.block_until_ready(fns[turn[0]](*args))
        for i in turn:
            samples[i].append(_sample(fns[i], args, reps[i]))
    return [sorted(x)[len(x) // 2] for x in samples]


def _check_config(bins: str, names: list[str]) -> int:
    """Correctness sweep of some compiled configs (run in a child process)."""
    import numpy as np

    entries = {x["name"]: x for x in json.load(open(os.path.join(bins, "index.json")))}
    failures = 0
    for name in names:
        e = entries[name]
        spec, cfg = GemmSpec(**e["spec"]), sm90_gemm.Config(**e["config"])
        binary = build.load_binary(os.path.join(bins, name))
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        print(f"---- {name} {cfg.key()}", flush=True)
        for i, prob in enumerate(PROBLEMS):
            for integer in ((False, True) if i < N_INT else (False,)):
                try:
                    ok, msg = check_one(binary, spec, cfg, prob, rng, integer)
                except Exception as ex:  # keep going: report every problem of this config
                    ok, msg = False, f"{type(ex).__name__}: {str(ex)[:300]}"
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {name:28s} {str(prob):30s} int={int(integer)}: {msg}", flush=True)
    return 1 if failures else 0


def bench_call(binary, spec, cfg, m, n, k, tag):
    """A jitted call of ``binary`` on a row-major A [m, k] and B as [k, n] ("kn", jnp.matmul's
    form) or [n, k] ("kk"), into a row-major C [m, n]."""
    b_ss = ((n, k, 1), (1, n, n * k)) if tag == "kn" else ((n, k, 1), (k, 1, n * k))
    return _make_call(binary, spec, cfg, m, n, k, 1, ((m, k, 1), (k, 1, m * k)), b_ss, (m, n), (m, n, 1),
                      (n, 1, m * n))


def _timed_call(bins, e_name, spec, cfg, m, n, k, tag):
    return bench_call(build.load_binary(os.path.join(bins, e_name)), spec, cfg, m, n, k, tag)


def chained_impls(bins: str, m: int, n: int, k: int, chain: int, keep=None) -> dict:
    """jnp.matmul ("xla"), jax_cute.matmul and the compiled configs of the (m, n, k) bench entry
    in ``bins`` (jnp.matmul's layouts), each as ``chain`` independent products per jit, by label
    (a config's key, "*" marking the heuristic's pick). ``keep``: config keys to keep (None:
    all). Without ``bins`` (no index.json) only the first two."""
    import jax
    import jax.numpy as jnp
    import jax_cute
    from common import _chained

    impls = {"xla": jax.jit(_chained(jnp.matmul)), "jax_cute.matmul": jax.jit(_chained(jax_cute.matmul))}
    path = os.path.join(bins, "index.json")
    index = json.load(open(path)) if os.path.exists(path) else []
    by_name = {x["name"]: x for x in index if "config" in x}
    for e in (x for x in index if x["purpose"] == "bench" and x["tag"] == "kn" and tuple(x["shape"]) == (m, n, k)):
        for name in e["configs"]:
            cfg = sm90_gemm.Config(**by_name[name]["config"])
            if keep is None or cfg.key() in keep:
                impls[("*" if name == e["pick"] else "") + label(by_name[name])] = jax.jit(_chained(_timed_call(bins, name, bench_specs()["kn"], cfg, m, n, k, "kn")))
    return impls


def chained_operands(m: int, n: int, k: int, chain: int, seed: int) -> list[tuple]:
    """``chain`` independent (A [m, k], B [k, n]) pairs of random bf16."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 2 * chain)
    return [(jax.random.normal(keys[2 * i], (m, k), jnp.bfloat16),
             jax.random.normal(keys[2 * i + 1], (k, n), jnp.bfloat16)) for i in range(chain)]


def _bench(bins: str, exp: bool = True) -> int:
    """Time every benchmark shape with each built config next to XLA (child process).
    exp=False leaves out the experimental configs (see experimental())."""
    import math
    import jax
    import jax.numpy as jnp

    index = json.load(open(os.path.join(bins, "index.json")))
    configs = {x["name"]: x for x in index if x["purpose"] == "perf"}
    specs = bench_specs()
    failures, rows, best = 0, [], []
    print(jax.devices()[0].device_kind, "jax", jax.__version__, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          flush=True)
    for e in index:
        if e["purpose"] != "bench":
            continue
        m, n, k = e["shape"]
        tag = e["tag"]
        spec = specs[tag]
        ka, kb = jax.random.split(jax.random.PRNGKey(0))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b_phys = jax.random.normal(kb, (k, n) if tag == "kn" else (n, k), jnp.bfloat16)
        if tag == "kn":
            ref = jax.jit(lambda x, y: jnp.matmul(x, y))
        else:
            ref = jax.jit(lambda x, y: jax.lax.dot_general(x, y, (((1,), (1,)), ((), ()))))
        want = ref(a, b_phys).astype(jnp.float32)
        fl = 2.0 * m * n * k
        names, fns, rels = [], [], []
        for name in e["configs"]:
            cfg = sm90_gemm.Config(**configs[name]["config"])
            if not exp and experimental(cfg) and name != e["pick"]:
                continue
            try:
                f = _timed_call(bins, name, spec, cfg, m, n, k, tag)
                got = f(a, b_phys).astype(jnp.float32)
                rel = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            except Exception as ex:
                print(f"FAIL timing {name} {m}x{n}x{k}: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                failures += 1
                continue
            if not rel < 1e-2:
                print(f"FAIL timing {name} {m}x{n}x{k}: result differs from XLA (rel {rel:.2g})", flush=True)
                failures += 1
            names.append(name)
            fns.append(f)
            rels.append(rel)
        if fl < CHAIN_BELOW_FLOPS:
            # device-bound timing: CHAIN products on independent (A, B) pairs in one jit (a
            # shared A would let XLA merge the dots into one, concatenating the Bs)
            pairs = tuple((jax.random.normal(jax.random.PRNGKey(200 + i), a.shape, jnp.bfloat16),
                           jax.random.normal(jax.random.PRNGKey(100 + i), b_phys.shape, jnp.bfloat16))
                          for i in range(CHAIN))
            chain = lambda g: jax.jit(lambda ps: [g(x, y) for x, y in ps])  # noqa: E731
            times = [t / CHAIN for t in _time_interleaved([chain(g) for g in [ref] + fns], (pairs,))]
            print(f"  {m}x{n}x{k} {tag}: timed as {CHAIN} chained products per jit", flush=True)
        else:
            times = _time_interleaved([ref] + fns, (a, b_phys))
        xla = fl / times[0] / 1e12
        shape_rows = []
        for name, t, rel in zip(names, times[1:], rels):
            cfg = sm90_gemm.Config(**configs[name]["config"])
            row = (f"{m}x{n}x{k}", tag, ("*" if name == e["pick"] else " ") + label(configs[name]), fl / t / 1e12, xla, rel)
            rows.append(row)
            shape_rows.append(row)
            print(f"  timed {row}", flush=True)
        if shape_rows:
            pick_rows = [r for r in shape_rows if r[2].startswith("*")] or shape_rows[:1]
            best.append((pick_rows[0], max(shape_rows, key=lambda r: r[3])))
    print(f"\n{'shape':18s} {'B':2s} {'config (* = heuristic pick)':38s} {'ours':>7s} {'xla':>7s} {'ratio':>6s} {'rel|d|':>8s}")
    for shape, tag, key, ours, xla, rel in rows:
        print(f"{shape:18s} {tag:2s} {key:38s} {ours:7.1f} {xla:7.1f} {ours / xla:6.3f} {rel:8.2g}")
    print("(TFLOP/s; per shape XLA and every config sampled in turn, 7 rounds of ~60 ms of async launches each,"
          " median; rel|d| = max|ours-xla| / max|xla|)")
    if best:
        print(f"\n{'shape':18s} {'B':2s} {'pick':30s} {'ours':>6s} {'best config':30s} {'best':>6s} {'xla':>6s}")
        for p, bst in best:
            print(f"{p[0]:18s} {p[1]:2s} {p[2][1:]:30s} {p[3]:6.1f} {bst[2].strip('* '):30s} {bst[3]:6.1f} {p[4]:6.1f}")
        g_pick = math.exp(sum(math.log(p[3] / p[4]) for p, _ in best) / len(best))
        g_best = math.exp(sum(math.log(b[3] / b[4]) for _, b in best) / len(best))
        print(f"geomean vs XLA: heuristic picks {g_pick:.3f}, best per shape {g_best:.3f}")
    _power_probe(bins, index, configs, specs)
    return 1 if failures else 0


def _power_probe(bins, index, configs, specs):
    """Same 8192^3 product on normal vs small-integer vs zero data: is the clock power-bound?"""
    import jax
    import jax.numpy as jnp
    e = [x for x in index if x["purpose"] == "bench" and x["shape"] == [8192, 8192, 8192] and x["tag"] == "kn"]
    if not e:
        return
    e = e[0]
    m = n = k = 8192
    name = e["pick"]
    cfg = sm90_gemm.Config(**configs[name]["config"])
    f = _timed_call(bins, name, specs["kn"], cfg, m, n, k, "kn")
    ref = jax.jit(lambda x, y: jnp.matmul(x, y))
    ka, kb = jax.random.split(jax.random.PRNGKey(1))
    data = {
        "normal": (jax.random.normal(ka, (m, k), jnp.bfloat16), jax.random.normal(kb, (k, n), jnp.bfloat16)),
        "int[-2,2]": (jax.random.randint(ka, (m, k), -2, 3).astype(jnp.bfloat16),
                      jax.random.randint(kb, (k, n), -2, 3).astype(jnp.bfloat16)),
        "zeros": (jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k, n), jnp.bfloat16)),
    }
    fl = 2.0 * m * n * k
    for what, args in data.items():
        t1, t2 = _time_interleaved([f, ref], args, rounds=5)
        print(f"power probe 8192^3 kn {what:10s} ours {fl / t1 / 1e12:6.1f}  xla {fl / t2 / 1e12:6.1f}", flush=True)


def cmd_run(bins: str, check_timeout: int = 150, bench_timeout: int = 300) -> int:
    """The checks (in child processes of at most 8 configs) and the benchmark run with timeouts,
    so that a hang (e.g. a pipeline barrier that never completes) is reported and the rest still
    runs. Every failure is listed again at the end; the exit status is non-zero on any."""
    import subprocess

    index = json.load(open(os.path.join(bins, "index.json")))
    me = os.path.abspath(__file__)
    fails, summary = [], []

    def child(args, timeout, label):
        lines = []
        try:
            p = subprocess.Popen([sys.executable, me, *args, "--bins", bins], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1)
            t_end = time.time() + timeout
            import selectors
            sel = selectors.DefaultSelector()
            sel.register(p.stdout, selectors.EVENT_READ)
            while True:
                left = t_end - time.time()
                if left <= 0:
                    p.kill()
                    p.wait()
                    last = [x for x in lines if x.startswith("----")]
                    fails.append(f"{label}: TIMEOUT after {timeout}s (hang?) in {last[-1] if last else '?'}")
                    return "TIMEOUT"
                if sel.select(timeout=min(left, 5.0)):
                    line = p.stdout.readline()
                    if not line:
                        break
                    print(line, end="", flush=True)
                    lines.append(line.rstrip("\n"))
            rc = p.wait()
        except Exception as ex:
            fails.append(f"{label}: {type(ex).__name__}: {ex}")
            return "ERROR"
        fails.extend(x for x in lines if x.startswith("FAIL"))
        if rc != 0 and not any(x.startswith("FAIL") for x in lines):
            fails.append(f"{label}: exit {rc}: " + " | ".join(lines[-3:]))
        return "ok" if rc == 0 else f"FAILED (rc {rc})"

    checks = [e for e in index if e["purpose"] == "check"]
    main = [e["name"] for e in checks if not experimental(sm90_gemm.Config(**e["config"]))]
    exp = [e["name"] for e in checks if experimental(sm90_gemm.Config(**e["config"]))]
    # children of at most 8 configs each (~9 s per config), so a hang costs one child's time
    parts = [(main[i:i + 8], False) for i in range(0, len(main), 8)]
    parts += [(exp[i:i + 8], True) for i in range(0, len(exp), 8)]
    exp_ok = True
    for part, is_exp in parts:
        res = child(["check", "--names", ",".join(part)], check_timeout, "check " + part[0])
        summary.append((part, res))
        if is_exp:
            exp_ok = exp_ok and res == "ok"
    # time the experimental configs only where they computed right
    bench = child(["bench", "--exp", "yes" if exp_ok else "no"], bench_timeout, "bench")
    n_fail_checks = sum(1 for x in fails if not x.startswith("FAIL timing") and not x.startswith("bench"))
    print(f"\n==== {len(fails)} failure(s) ({n_fail_checks} in the checks); benchmark {bench}")
    for x in fails:
        print("  " + x)
    ok = not fails and all(r == "ok" for _, r in summary) and bench == "ok"
    print("overall:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    b.add_argument("--no-sweep", action="store_true", help="bench only the heuristic's picks")
    b.add_argument("--tags", help="operand forms to bench (kn,kk; default both)")
    b.add_argument("--checks", help="substrings of the check configs to build (default all)")
    b.add_argument("--shapes", help="benchmark shapes, e.g. 2048x2048x2048,8192x8192x8192")
    b.add_argument("--old", help="bins directory from an earlier commit to time alongside")
    b.add_argument("--old-configs", help="substrings of the --old objects to take (default all)")
    for cmd in ("run", "check", "bench"):
        r = sub.add_parser(cmd)
        r.add_argument("--bins", required=True)
        if cmd == "check":
            r.add_argument("--names", required=True, help="comma-separated check configs")
        if cmd == "bench":
            r.add_argument("--exp", choices=("yes", "no"), default="yes")
    args = p.parse_args()
    if args.cmd == "build":
        split = lambda x: x.split(",") if x else None  # noqa: E731
        cmd_build(args.out, sweep=not args.no_sweep, tags=split(args.tags), checks=split(args.checks),
                  shapes=parse_shapes(args.shapes, None),
                  old=args.old, old_configs=split(args.old_configs))
        return 0
    if args.cmd == "check":
        return _check_config(args.bins, args.names.split(","))
    if args.cmd == "bench":
        return _bench(args.bins, args.exp == "yes")
    return cmd_run(args.bins)


if __name__ == "__main__":
    sys.exit(main())

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
start NaN-filled (config.nan_fill) and must hold no NaN inside C and only NaN in its padding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_cute.kernels import build, sm90_gemm  # noqa: E402  (neither imports the DSL compiler)
from jax_cute.kernels.gemm_spec import GemmSpec, reference_gemm  # noqa: E402

BENCH_SHAPES = [(8192, 8192, 8192), (4096, 14336, 4096), (4096, 4096, 4096), (2048, 2048, 2048),
                (4096, 4096, 14336), (16384, 2048, 2048), (512, 8192, 8192)]
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
    ("c_bf16_mnm_f32_sk4", GemmSpec(BF, BF, "float32", "m", "n", "m"), C(128, 128, 1, 2, split_k=4)),
    ("c_f16_knn_f16_sk4", GemmSpec("float16", "float16", "float16", "k", "n", "n"), C(128, 256, 1, 2, split_k=4)),
]

# (M, N, K, L, which operand is broadcast over L: None/"a"/"b")
PROBLEMS = [(1000, 1032, 776, 1, None), (264, 136, 72, 1, None), (1001, 1003, 520, 3, "a"),
            (300, 260, 1000, 2, "b"), (8, 16, 8, 1, None), (128, 256, 64, 1, None), (520, 2056, 4096, 1, None)]


def bench_specs():
    # jnp.matmul(a[M,K], b[K,N]) is a k-major, b n-major, c n-major; also the (N,K) weight form
    return {"kn": GemmSpec(BF, BF, BF, "k", "n", "n"), "kk": GemmSpec(BF, BF, BF, "k", "k", "n")}


def cmd_build(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    index = []

    def add(name, spec, cfg, purpose, shape=None):
        t = time.time()
        binary = build.compile_launcher(sm90_gemm.launcher(spec, cfg), sm90_gemm.signature(spec, cfg),
                                        arch=sm90_gemm.ARCH, name=name)
        build.save_binary(binary, os.path.join(out, name))
        index.append({"name": name, "spec": dataclasses.asdict(spec), "config": dataclasses.asdict(cfg),
                      "purpose": purpose, "shape": shape})
        print(f"  built {name:42s} {cfg.key():32s} {time.time() - t:5.1f}s", flush=True)

    for name, spec, cfg in CHECKS:
        add(name, spec, cfg, "check")
    built = {}
    for tag, spec in bench_specs().items():
        for (m, n, k) in BENCH_SHAPES:
            cfg = sm90_gemm.heuristic(spec, m, n, k, 1)
            print(f"heuristic {tag} {m}x{n}x{k}: {cfg.key()}")
            name = f"p_{tag}_{cfg.key().replace('.', '_')}"
            if name not in built:
                add(name, spec, cfg, "perf")
                built[name] = True
            index.append({"name": name, "purpose": "bench", "tag": tag, "shape": [m, n, k]})
    # split-K alternatives for the thin shape, to compare with the heuristic's pick
    for cfg in (C(128, 128, 2, 1, split_k=2), C(128, 256, 2, 1, split_k=2)):
        name = f"p_kn_{cfg.key().replace('.', '_')}"
        if name not in built:
            add(name, bench_specs()["kn"], cfg, "perf")
            built[name] = True
        index.append({"name": name, "purpose": "bench_alt", "tag": "kn", "shape": [512, 8192, 8192]})
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
    if np.isnan(got).any():
        return False, f"{int(np.isnan(got).sum())} NaN left in C"
    if pad.size and not np.isnan(pad).all():
        return False, "wrote into C's padding"
    if integer:
        want = ref.astype(out_dt).astype(np.float32)
        bad = int((got != want).sum())
        return bad == 0, f"exact: {bad} mismatches"
    tol = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 1e-3}[spec.c_dtype]
    err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
    return err <= tol, f"rel err {err:.2e} (tol {tol:.0e})"


def _time(fn, args, reps=20, rounds=5) -> float:
    import jax
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t) / reps)
    return sorted(samples)[len(samples) // 2]


def _check_config(bins: str, name: str) -> int:
    """Correctness sweep of one compiled config (run in a child process)."""
    import numpy as np

    e = {x["name"]: x for x in json.load(open(os.path.join(bins, "index.json")))}[name]
    spec, cfg = GemmSpec(**e["spec"]), sm90_gemm.Config(**e["config"])
    binary = build.load_binary(os.path.join(bins, name))
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    failures = 0
    for i, prob in enumerate(PROBLEMS):
        for integer in ((False, True) if i < 4 else (False,)):
            try:
                ok, msg = check_one(binary, spec, cfg, prob, rng, integer)
            except Exception as ex:  # keep going: report every problem of this config
                ok, msg = False, f"{type(ex).__name__}: {str(ex)[:300]}"
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name:28s} {str(prob):30s} int={int(integer)}: {msg}", flush=True)
    return 1 if failures else 0


def _bench(bins: str) -> int:
    """Time the benchmark shapes next to XLA (run in a child process); prints the table."""
    import jax
    import jax.numpy as jnp

    index = json.load(open(os.path.join(bins, "index.json")))
    configs = {x["name"]: x for x in index if x["purpose"] == "perf"}
    specs = bench_specs()
    failures, rows = 0, []
    print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    for e in index:
        if e["purpose"] not in ("bench", "bench_alt"):
            continue
        m, n, k = e["shape"]
        spec, cfg = specs[e["tag"]], sm90_gemm.Config(**configs[e["name"]]["config"])
        ka, kb = jax.random.split(jax.random.PRNGKey(0))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b_phys = jax.random.normal(kb, (k, n) if e["tag"] == "kn" else (n, k), jnp.bfloat16)
        b_ss = ((n, k, 1), (1, n, n * k)) if e["tag"] == "kn" else ((n, k, 1), (k, 1, n * k))
        f = _make_call(build.load_binary(os.path.join(bins, e["name"])), spec, cfg, m, n, k, 1,
                       ((m, k, 1), (k, 1, m * k)), b_ss, (m, n), (m, n, 1), (n, 1, m * n))
        if e["tag"] == "kn":
            ref = jax.jit(lambda x, y: jnp.matmul(x, y))
        else:
            ref = jax.jit(lambda x, y: jax.lax.dot_general(x, y, (((1,), (1,)), ((), ()))))
        try:
            t_ours = _time(f, (a, b_phys))
            got, want = f(a, b_phys).astype(jnp.float32), ref(a, b_phys).astype(jnp.float32)
            rel = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        except Exception as ex:
            print(f"FAIL timing {e['name']} {m}x{n}x{k}: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
            failures += 1
            continue
        t_xla = _time(ref, (a, b_phys))
        fl = 2.0 * m * n * k
        rows.append((f"{m}x{n}x{k}", e["tag"], ("" if e["purpose"] == "bench" else "alt ") + cfg.key(),
                     fl / t_ours / 1e12, fl / t_xla / 1e12, rel))
        print(f"  timed {rows[-1]}", flush=True)
    print(f"\n{'shape':18s} {'B':2s} {'config':38s} {'ours':>7s} {'xla':>7s} {'ratio':>6s} {'rel|d|':>8s}")
    for shape, tag, key, ours, xla, rel in rows:
        print(f"{shape:18s} {tag:2s} {key:38s} {ours:7.1f} {xla:7.1f} {ours / xla:6.3f} {rel:8.2g}")
    print("(TFLOP/s, median of 5 rounds x 20 async launches; rel|d| = max|ours-xla| / max|xla|)")
    return 1 if failures else 0


def cmd_run(bins: str, check_timeout: int = 150, bench_timeout: int = 300) -> int:
    """Each config's check and the benchmark run in child processes with a timeout, so that a
    hang (e.g. a pipeline barrier that never completes) is reported and the rest still runs."""
    import subprocess

    index = json.load(open(os.path.join(bins, "index.json")))
    me = os.path.abspath(__file__)
    summary = []

    def child(args, timeout):
        try:
            r = subprocess.run([sys.executable, me, *args, "--bins", bins], timeout=timeout)
            return "ok" if r.returncode == 0 else f"FAILED (rc {r.returncode})"
        except subprocess.TimeoutExpired:
            return f"TIMEOUT after {timeout}s (hang?)"

    for e in index:
        if e["purpose"] == "check":
            summary.append((e["name"], e["config"], child(["check-one", "--name", e["name"]], check_timeout)))
    print("\ncorrectness by config:")
    for name, cfg, res in summary:
        print(f"  {name:28s} {sm90_gemm.Config(**cfg).key():32s} {res}")
    print(flush=True)
    bench = child(["bench"], bench_timeout)   # its table comes last
    print(f"overall: {sum(r == 'ok' for *_, r in summary)}/{len(summary)} configs correct; benchmark {bench}")
    return 0 if all(r == "ok" for *_, r in summary) and bench == "ok" else 1


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    for cmd in ("run", "check-one", "bench"):
        r = sub.add_parser(cmd)
        r.add_argument("--bins", required=True)
        if cmd == "check-one":
            r.add_argument("--name", required=True)
    args = p.parse_args()
    if args.cmd == "build":
        cmd_build(args.out)
        return 0
    if args.cmd == "check-one":
        return _check_config(args.bins, args.name)
    if args.cmd == "bench":
        return _bench(args.bins)
    return cmd_run(args.bins)


if __name__ == "__main__":
    sys.exit(main())

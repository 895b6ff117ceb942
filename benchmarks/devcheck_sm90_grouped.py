"""GPU check of the sm90_grouped family (Hopper grouped GEMM for MoE).

    python benchmarks/devcheck_sm90_grouped.py build --out DIR   # CPU machine with the DSL
    python benchmarks/devcheck_sm90_grouped.py run --bins DIR    # GPU machine (no DSL compiler)

``build`` compiles the kernels and saves them with an index; ``run`` loads them, checks them on
fresh random data against a float64 numpy reference of the GroupedSpec arithmetic (uniform,
skewed, empty groups, sum < M, sum > M, negative sizes, last tiles of 1 to 193 rows, odd
extents, batches with broadcast, NaN-prefilled outputs, a jitted replay with new group sizes),
then times forward and rhs-gradient TFLOP/s of every binary next to the suite's Pallas
Mosaic-GPU configs (benchmarks/common.measure on bench_ragged's group sizes), and prints a table
last. Environment: DEVCHECK_SKIP_CHECKS=1 (timings only), DEVCHECK_NO_PALLAS=1, DEVCHECK_G
(group counts of the shapes to time, e.g. "64,16").
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (role, mode, dtype, out dtype, a_major, b_major, c_major, tile_n[, extra])
#   extra "diag": spec refused by unsupported(); built anyway, its checks are informational
BINS = [
    ("drhs", "ragged_k", "bfloat16", "bfloat16", "m", "n", "n", 256),
    ("drhs", "ragged_k", "bfloat16", "bfloat16", "m", "n", "n", 128),
    ("drhs32", "ragged_k", "bfloat16", "float32", "m", "n", "n", 256),
    ("drhsT", "ragged_k", "float16", "float16", "m", "n", "m", 128),
    ("fwd", "ragged_m", "bfloat16", "bfloat16", "k", "n", "n", 256),
    ("fwd", "ragged_m", "bfloat16", "bfloat16", "k", "n", "n", 128),
    ("dlhs", "ragged_m", "bfloat16", "bfloat16", "k", "k", "n", 256),
    ("dlhs", "ragged_m", "bfloat16", "bfloat16", "k", "k", "n", 128),
    ("fwd16", "ragged_m", "float16", "float16", "k", "n", "n", 256),
    ("fwd32", "ragged_m", "bfloat16", "float32", "k", "n", "n", 128),
    ("fwdmA", "ragged_m", "bfloat16", "bfloat16", "m", "n", "n", 128, "diag"),
]


def _name(b):
    x = f"_{b[8]}" if len(b) > 8 else ""
    return f"{b[0]}_{b[1]}_{b[2]}_{b[3]}_{b[4]}{b[5]}{b[6]}_n{b[7]}{x}"


def cmd_build(out):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from jax_cute.kernels import build, sm90_grouped as fam
    from jax_cute.kernels.gemm_spec import GroupedSpec
    os.makedirs(out, exist_ok=True)
    index = []
    for b in BINS:
        role, mode, dt, cdt, am, bm, cm, tn = b[:8]
        extra = b[8] if len(b) > 8 else ""
        spec = GroupedSpec(mode, dt, dt, cdt, a_major=am, b_major=bm, c_major=cm)
        cfg = fam.Config(tile_n=tn)
        t = time.time()
        launch = fam._build(spec, cfg) if extra == "diag" else fam.launcher(spec, cfg)
        kb = build.compile_launcher(launch, fam.signature(spec, cfg), arch=fam.ARCH,
                                    name=f"{fam.FAMILY}.{spec.key()}.{cfg.key()}")
        build.save_binary(kb, os.path.join(out, _name(b)))
        index.append(dict(file=_name(b), role=role, mode=mode, dtype=dt, out_dtype=cdt, a_major=am,
                          b_major=bm, c_major=cm, tile_n=tn, extra=extra, version=fam.VERSION,
                          config=cfg.key()))
        print(f"built {_name(b)} in {time.time() - t:.1f}s", flush=True)
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)


# --------------------------------------------------------------------------------------------
# run (GPU)

def _offsets(sizes, extent):
    import numpy as np
    return np.clip(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), 0, extent)


def ref_ragged_m(a, b, gs):
    """a (L,M,K) or (1,...); b (Lb,G,N,K) logical; gs (Lg,G) -> (L,M,N) float64."""
    import numpy as np
    L = max(a.shape[0], b.shape[0], gs.shape[0])
    M, N = a.shape[1], b.shape[2]
    out = np.zeros((L, M, N))
    for l in range(L):
        al, bl, gl = a[min(l, a.shape[0] - 1)], b[min(l, b.shape[0] - 1)], gs[min(l, gs.shape[0] - 1)]
        off = _offsets(gl, M)
        lo = 0
        for g, hi in enumerate(off):
            out[l, lo:hi] = al[lo:hi].astype(np.float64) @ bl[g].astype(np.float64).T
            lo = hi
    return out


def ref_ragged_k(a, b, gs):
    """a (L,T,Km) tokens-major lhs; b (L,T,N) dout; gs (Lg,G) -> (L,G,Km,N) float64."""
    import numpy as np
    L = max(a.shape[0], b.shape[0], gs.shape[0])
    T, Km, N, G = a.shape[1], a.shape[2], b.shape[2], gs.shape[1]
    out = np.zeros((L, G, Km, N))
    for l in range(L):
        al, bl, gl = a[min(l, a.shape[0] - 1)], b[min(l, b.shape[0] - 1)], gs[min(l, gs.shape[0] - 1)]
        off = _offsets(gl, T)
        lo = 0
        for g, hi in enumerate(off):
            out[l, g] = al[lo:hi].astype(np.float64).T @ bl[lo:hi].astype(np.float64)
            lo = hi
    return out


class Runner:
    def __init__(self, bins):
        with open(os.path.join(bins, "index.json")) as f:
            self.index = json.load(f)
        self.dir = bins
        self.bin = {}

    def find(self, role, tile_n, extra=""):
        for e in self.index:
            if e["role"] == role and e["tile_n"] == tile_n and e.get("extra", "") == extra:
                return e
        return None

    def entry(self, file):
        return {e["file"]: e for e in self.index}[file]

    def call(self, e, a, b, gs):
        """Physical arrays: ragged_m: a (La,M,K) [k-major] or (La,K,M) [m-major]; b (Lb,G,K,N)
        [n-major] or (Lb,G,N,K) [k-major]; ragged_k: a (La,T,Km), b (Lb,T,N). gs (Lg,G)."""
        import jax
        import jax.numpy as jnp
        from jax_cute.launch import kernel_call
        from jax_cute.kernels import build
        if e["file"] not in self.bin:
            self.bin[e["file"]] = build.load_binary(os.path.join(self.dir, e["file"]))
        kb = self.bin[e["file"]]
        cdt = jnp.dtype(e["out_dtype"])
        Lg, G = gs.shape
        gsd = (gs, (G, Lg), (1, G))
        if e["mode"] == "ragged_m":
            La = a.shape[0]
            if e["a_major"] == "k":
                _, M, K = a.shape
                ad = (a, (M, K, La), (K, 1, M * K))
            else:
                _, K, M = a.shape
                ad = (a, (M, K, La), (1, M, K * M))
            Lb = b.shape[0]
            if e["b_major"] == "n":
                _, _, _, N = b.shape
                bd = (b, (N, K, G, Lb), (1, N, K * N, G * K * N))
            else:
                _, _, N, _ = b.shape
                bd = (b, (N, K, G, Lb), (K, 1, N * K, G * N * K))
            L = max(La, Lb, Lg)
            out = (jax.ShapeDtypeStruct((L, M, N), cdt), (M, N, L), (N, 1, M * N))
        else:
            La, T, Km = a.shape
            Lb, _, N = b.shape
            ad = (a, (Km, T, La), (1, Km, T * Km))
            bd = (b, (N, T, Lb), (1, N, T * N))
            L = max(La, Lb, Lg)
            if e["c_major"] == "n":
                out = (jax.ShapeDtypeStruct((L, G, Km, N), cdt), (Km, N, G, L), (N, 1, Km * N, G * Km * N))
            else:
                out = (jax.ShapeDtypeStruct((L, G, N, Km), cdt), (Km, N, G, L), (1, Km, Km * N, G * Km * N))
        res = kernel_call(kb, inputs={"a": ad, "b": bd, "group_sizes": gsd}, outputs={"c": out})["c"]
        if e["mode"] == "ragged_k" and e["c_major"] == "m":
            res = jnp.swapaxes(res, -1, -2)
        return res


def _sizes(rng, kind, G, M):
    import numpy as np
    if kind == "uniform":
        s = np.full(G, M // G)
        s[: M - s.sum()] += 1
    elif kind == "skewed":
        p = rng.dirichlet(np.full(G, 0.3))
        s = np.floor(p * M).astype(np.int64)
        s[np.argmax(s)] += M - s.sum()
    elif kind == "empty":      # several empty groups, including the first and the last
        s = np.zeros(G, np.int64)
        live = rng.choice(np.arange(1, G - 1), size=max(1, G // 3), replace=False)
        s[live] = rng.multinomial(M, np.full(len(live), 1 / len(live)))
    elif kind == "short":      # sum < M: trailing rows are zeros / ignored
        s = rng.multinomial(M * 2 // 3, np.full(G, 1 / G))
    elif kind == "over":       # sum > M: offsets clip at M
        s = rng.multinomial(M * 3 // 2, np.full(G, 1 / G))
    elif kind == "negative":   # negative sizes count as zero
        s = rng.multinomial(M, np.full(G, 1 / G)).astype(np.int64)
        s[::3] = -rng.integers(1, 50, size=len(s[::3]))
    elif kind in ("align128", "align8"):   # boundaries on multiples of 128 / 8 rows
        q = 128 if kind == "align128" else 8
        s = rng.multinomial(M // q, np.full(G, 1 / G)) * q
    elif kind == "tails":      # last tiles of 1, 63, 64, 65, 127, 128, 129 ... rows
        s = rng.choice(np.array([1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 0]), size=G)
    elif kind == "huge":       # int32 extremes must not overflow the device scan
        s = np.zeros(G, np.int64)
        s[1] = 2**31 - 1
        s[2] = 2**31 - 1
        s[0] = 7
    return s.astype(np.int32)


def _rel_err(out, ref):
    import numpy as np
    out = np.asarray(out, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(1.0, float(np.max(np.abs(ref)))))


KINDS = ("uniform", "skewed", "empty", "short", "over", "negative", "huge", "tails")
SHAPES_M = [(1000, 200, 264, 7), (4096, 512, 1024, 16), (257, 64, 136, 33), (2048, 128, 512, 64)]
SHAPES_K = [(1000, 200, 264, 7), (4096, 512, 1024, 16), (259, 64, 136, 33), (2048, 128, 512, 64),
            (384, 136, 72, 130)]


def check_binary(r, e, rng, kinds=KINDS):
    """Correctness of one binary on fresh random data, NaN-prefilled outputs; returns results."""
    import numpy as np
    import jax
    import jax.numpy as jnp
    os.environ["JAX_CUTE_NAN_FILL"] = "1"  # outputs start as NaN: unwritten elements show
    results = []
    f = jax.jit(lambda a, b, gs: r.call(e, a, b, gs))

    def rnd(shape, dt):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dt)

    def check(label, a, b, gs, ref_fn, tol):
        try:
            out = np.asarray(f(a, b, gs).astype(jnp.float32))
            err = _rel_err(out, ref_fn())
            ok = err <= tol
        except Exception as ex:  # keep going: report every case
            err, ok = repr(ex)[:160], False
        results.append((label, ok, err))
        print(f"{'PASS' if ok else 'FAIL'} {label:<40} {e['file']:<44} err={err}", flush=True)

    tol = 1e-5 if e["out_dtype"] == "float32" else 1e-2
    dt = jnp.dtype(e["dtype"])
    f32 = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    if e["mode"] == "ragged_m":
        for (M, K, N, G) in SHAPES_M:
            if e["a_major"] == "m" and M % 8:
                M += 8 - M % 8
            phys_a = lambda x: x if e["a_major"] == "k" else jnp.swapaxes(x, 1, 2)  # noqa: E731
            phys_b = lambda x: x if e["b_major"] == "k" else jnp.swapaxes(x, 2, 3)  # noqa: E731
            for kind in kinds:
                s = _sizes(rng, kind, G, M)[None]
                a_log, b_log = rnd((1, M, K), dt), rnd((1, G, N, K), dt)
                check(f"m {M}x{K}x{N} G{G} {kind}", phys_a(a_log), phys_b(b_log), jnp.asarray(s),
                      lambda: ref_ragged_m(f32(a_log), f32(b_log), s), tol)
            if (M, K, N, G) != SHAPES_M[0] or len(kinds) < 3:
                continue
            # batches: L=3 with B broadcast (L=1) and per-batch group sizes
            s = np.stack([_sizes(rng, k, G, M) for k in ("uniform", "skewed", "short")])
            a_log, b_log = rnd((3, M, K), dt), rnd((1, G, N, K), dt)
            check(f"m {M}x{K}x{N} G{G} L3 bcast-b", phys_a(a_log), phys_b(b_log), jnp.asarray(s),
                  lambda: ref_ragged_m(f32(a_log), f32(b_log), s), tol)
    else:
        # ragged_k (rhs gradient): out[g] = lhs[rows of g]^T . dout[rows of g]
        for (T, Km, N, G) in SHAPES_K:
            for kind in kinds:
                s = _sizes(rng, kind, G, T)[None]
                a, b = rnd((1, T, Km), dt), rnd((1, T, N), dt)
                check(f"k {T}x{Km}x{N} G{G} {kind}", a, b, jnp.asarray(s),
                      lambda: ref_ragged_k(f32(a), f32(b), s), tol)
            if (T, Km, N, G) != SHAPES_K[0]:
                continue
            # batches: L=2, per-batch sizes, dout broadcast; and L=3 with lhs broadcast, sizes L=1
            s = np.stack([_sizes(rng, k, G, T) for k in ("skewed", "empty")])
            a, b = rnd((2, T, Km), dt), rnd((1, T, N), dt)
            check(f"k {T}x{Km}x{N} G{G} L2 bcast-b", a, b, jnp.asarray(s),
                  lambda: ref_ragged_k(f32(a), f32(b), s), tol)
            s = _sizes(rng, "skewed", G, T)[None]
            a, b = rnd((1, T, Km), dt), rnd((3, T, N), dt)
            check(f"k {T}x{Km}x{N} G{G} L3 bcast-a,gs", a, b, jnp.asarray(s),
                  lambda: ref_ragged_k(f32(a), f32(b), s), tol)
    # replay: one jitted function, new group sizes on each call (must not be baked in)
    if e["role"] in ("fwd", "drhs") and e["tile_n"] == 256 and not e.get("extra"):
        M, K, N, G = 3000, 256, 512, 12
        if e["role"] == "fwd":
            a, b = rnd((1, M, K), dt), rnd((1, G, K, N), dt)
            ref = lambda s: ref_ragged_m(f32(a), f32(jnp.swapaxes(b, 2, 3)), s)  # noqa: E731
        else:
            a, b = rnd((1, M, K), dt), rnd((1, M, N), dt)
            ref = lambda s: ref_ragged_k(f32(a), f32(b), s)  # noqa: E731
        for i, kind in enumerate(("uniform", "skewed", "empty", "short", "skewed")):
            s = _sizes(rng, kind, G, M)[None]
            check(f"replay #{i} {kind}", a, b, jnp.asarray(s), lambda: ref(s), 1e-2)
    os.environ["JAX_CUTE_NAN_FILL"] = "0"
    return results


BENCH_SHAPES = [(8, 16384, 4096, 14336), (64, 32768, 2048, 1408), (16, 16384, 2048, 16384),
                (128, 16384, 4096, 1536)]


def run_bench(r, which, out_json):
    """which: "fwd" or "drhs". Every config binary of ours next to the benchmark suite's Pallas
    configs, timed with the suite's method (benchmarks/common.measure: rotated rounds, 50 ms
    samples) on the suite's own group sizes (bench_ragged.group_sizes), so a ranking here is
    the ranking the suite would see. Appends one dict per (shape, sizes) to out_json."""
    import jax.numpy as jnp
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import Impl, measure
    from bench_ragged import group_sizes, pallas_impls, random_operands
    os.environ["JAX_CUTE_NAN_FILL"] = "0"
    ours = [(f"{which} n{tn}", r.find(which, tn)) for tn in (256, 128)]
    ours = [(k, e) for k, e in ours if e is not None]
    shapes = [x for x in BENCH_SHAPES if str(x[0]) in os.environ.get("DEVCHECK_G", "8,64,16,128").split(",")]
    for (G, M, K, N) in shapes:
        impls = [Impl("jax_cute", (lambda lhs, rhs, gs, ct, e=e: r.call(e, lhs[None], rhs[None], gs[None])[0])
                      if which == "fwd" else
                      (lambda lhs, rhs, gs, ct, e=e: r.call(e, lhs[None], ct[None], gs[None])[0]), k)
                 for k, e in ours]
        if os.environ.get("DEVCHECK_NO_PALLAS") != "1":
            impls += pallas_impls(which, N)
        for dist in ("uniform", "dirichlet0.3"):
            mk = random_operands(G, M, K, N, jnp.asarray(group_sizes(G, M, dist)))
            recs = measure("devcheck", which, f"{which} G{G} {dist}", impls, mk, 2.0 * M * K * N, rounds=5)
            row = {"shape": f"G{G} M{M} K{K} N{N}", "sizes": "uniform" if dist == "uniform" else "skewed"}
            for rec in recs:
                key = rec["config"] if rec["impl"] == "jax_cute" else f"{which} pallas"
                row[key] = max(row.get(key, 0.0), rec["tflops"] or 0.0)
                if rec.get("max_rel_err", 0) > 2e-2:
                    print(f"MISMATCH {rec['config']} {row['shape']} {dist}: {rec['max_rel_err']}", flush=True)
            print(row, flush=True)
            with open(out_json, "a") as fh:
                fh.write(json.dumps(row) + "\n")


def _print_table(rows):
    import math
    for which in ("fwd", "drhs"):
        rr = [x for x in rows if f"{which} n256" in x]
        if not rr:
            continue
        cols = [c for c in rr[0] if c.startswith(which)]
        print(f"\n== {which} TFLOP/s (bf16, median); ours = the tile_n that heuristic() picks")
        print(f"{'shape':<26}{'sizes':<9}" + "".join(f"{c.replace(which + ' ', ''):>11}" for c in cols)
              + f"{'ours/pallas':>12}")
        ratios_p = []
        for x in rr:
            G, M, K, N = (int(v[1:]) for v in x["shape"].split())
            best = x.get(f"{which} {_heur_tile(which, G, M, K, N)}", 0)
            p = x.get(f"{which} pallas", 0)
            rp = best / p if p else float("nan")
            if p and best:
                ratios_p.append(rp)
            print(f"{x['shape']:<26}{x['sizes']:<9}" + "".join(f"{x.get(c, 0):>11.1f}" for c in cols)
                  + f"{rp:>12.3f}")
        gm = lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")  # noqa: E731
        print(f"geomean ours/pallas {gm(ratios_p):.3f}")
        for x in rr:
            if x["sizes"] == "skewed":
                u = [y for y in rr if y["shape"] == x["shape"] and y["sizes"] == "uniform"]
                G, M, K, N = (int(v[1:]) for v in x["shape"].split())
                if u:   # every config of ours, the heuristic's pick marked
                    pick = f"{which} {_heur_tile(which, G, M, K, N)}"
                    print(f"  skewed/uniform {x['shape']}: " + "  ".join(
                        f"{c.replace(which + ' ', '')}{'*' if c == pick else ''} {x[c] / u[0][c]:.3f}"
                        for c in cols if "pallas" not in c and u[0].get(c)))


def _heur_tile(which, G, M, K, N):
    """The bench column of the config heuristic() picks: "n256" or "n128"."""
    from jax_cute.kernels import sm90_grouped as fam
    from jax_cute.kernels.gemm_spec import GroupedSpec
    if which == "fwd":
        spec = GroupedSpec("ragged_m", "bfloat16", "bfloat16", "bfloat16", b_major="n")
        cfg = fam.heuristic(spec, M, N, K, G, 1)
    else:
        spec = GroupedSpec("ragged_k", "bfloat16", "bfloat16", "bfloat16", a_major="m", b_major="n")
        cfg = fam.heuristic(spec, K, N, M, G, 1)
    return f"n{cfg.tile_n}"


def cmd_run(bins, skip_bench=False, budget=228.0, which="fwd,drhs"):
    """Every binary's checks run in their own child process (in parallel: a crash, e.g. an
    illegal instruction that poisons the CUDA context, only loses that binary), then the
    forward and rhs-gradient benchmarks in two more children, within ``budget`` seconds."""
    import subprocess
    t0 = time.time()
    with open(os.path.join(bins, "index.json")) as f:
        index = json.load(f)
    out = os.environ.get("OUT") or "/tmp/devcheck_grouped"
    logs = os.path.join(out, "grouped_children")
    os.makedirs(logs, exist_ok=True)
    me = os.path.abspath(__file__)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    jobs = []  # (name, args, informational)
    for e in [] if os.environ.get("DEVCHECK_SKIP_CHECKS") == "1" else index:
        if e.get("extra") == "diag":
            for kinds in ("align128", "align8", "uniform"):
                jobs.append((f"{e['file']}[{kinds}]", ["check-one", "--file", e["file"], "--kinds", kinds], True))
        else:
            jobs.append((e["file"], ["check-one", "--file", e["file"]], False))
    procs = []
    for name, args, info in jobs:
        fh = open(os.path.join(logs, name.replace("[", "_").replace("]", "") + ".log"), "w")
        procs.append((name, info, fh, subprocess.Popen([sys.executable, me, *args, "--bins", bins],
                                                         stdout=fh, stderr=subprocess.STDOUT, env=env)))
    summary = []
    check_deadline = t0 + min(110.0, budget * 0.45)
    for name, info, fh, p in procs:
        try:
            rc = p.wait(timeout=max(1.0, check_deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = "TIMEOUT"
        fh.close()
        lines = open(fh.name, errors="replace").read().splitlines()
        res = [ln for ln in lines if ln.startswith(("PASS", "FAIL"))]
        fails = [ln for ln in res if ln.startswith("FAIL")]
        summary.append((name, info, rc, len(res) - len(fails), len(res), fails))
    print(f"== correctness by binary ({time.time() - t0:.0f}s)")
    bad = False
    for name, info, rc, npass, n, fails in summary:
        status = "ok" if rc == 0 and not fails and n else f"FAILED rc={rc}"
        if status != "ok" and not info:
            bad = True
        print(f"  {name:<52} {npass:>3}/{n:<3} {status}{'  (informational)' if info else ''}")
        for ln in fails[:4]:
            print("     " + " ".join(ln.split())[:230])
        if len(fails) > 4:
            print(f"     ... {len(fails) - 4} more")
    sys.stdout.flush()
    rows = []
    if not skip_bench:
        bench_json = os.path.join(out, "grouped_bench.jsonl")
        if os.path.exists(bench_json):
            os.remove(bench_json)
        plan = {"fwd": 0.62, "drhs": 1.0} if which == "fwd,drhs" else {w: 1.0 for w in which.split(",")}
        for which, share in plan.items():
            left = budget - (time.time() - t0)
            timeout = max(5.0, left * share)
            try:
                rc = subprocess.run([sys.executable, me, "bench", "--which", which, "--bins", bins,
                                     "--json", bench_json], timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = f"TIMEOUT after {timeout:.0f}s"
            print(f"bench {which}: rc={rc}", flush=True)
            if rc != 0:
                bad = True
        if os.path.exists(bench_json):
            rows = [json.loads(ln) for ln in open(bench_json)]
        _print_table(rows)
    print(f"\noverall: {'FAIL' if bad else 'OK'} ({time.time() - t0:.0f}s)")
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    rr = sub.add_parser("run")
    rr.add_argument("--bins", required=True)
    rr.add_argument("--no-bench", action="store_true")
    rr.add_argument("--budget", type=float, default=228.0, help="seconds for checks and benchmarks")
    rr.add_argument("--which", default="fwd,drhs", help="benchmarks to run: fwd, drhs or both")
    c = sub.add_parser("check-one")
    c.add_argument("--bins", required=True)
    c.add_argument("--file", required=True)
    c.add_argument("--kinds", default=",".join(KINDS))
    bb = sub.add_parser("bench")
    bb.add_argument("--bins", required=True)
    bb.add_argument("--which", choices=("fwd", "drhs"), required=True)
    bb.add_argument("--json", required=True)
    args = p.parse_args()
    if args.cmd == "build":
        cmd_build(args.out)
    elif args.cmd == "run":
        sys.exit(cmd_run(args.bins, args.no_bench, args.budget, args.which))
    elif args.cmd == "check-one":
        import zlib
        import numpy as np
        r = Runner(args.bins)
        rng = np.random.default_rng(zlib.crc32(args.file.encode()) + int(time.time()) % 1000)
        res = check_binary(r, r.entry(args.file), rng, tuple(args.kinds.split(",")))
        sys.exit(0 if res and all(x[1] for x in res) else 1)
    else:
        run_bench(Runner(args.bins), args.which, args.json)


if __name__ == "__main__":
    main()

"""GPU check of the sm90_grouped family (Hopper grouped GEMM for MoE).

    python benchmarks/devcheck_sm90_grouped.py build --out DIR   # CPU machine with the DSL
    python benchmarks/devcheck_sm90_grouped.py run --bins DIR    # GPU machine (no DSL compiler)

``build`` compiles the kernels and saves them with an index; ``run`` loads them, checks them on
fresh random data against a float64 numpy reference of the GroupedSpec arithmetic (uniform,
skewed, empty groups, sum < M, sum > M, negative sizes, odd extents, batches with broadcast,
NaN-prefilled outputs, a jitted replay with new group sizes), then times forward and rhs-gradient
TFLOP/s next to jax.lax.ragged_dot and the Pallas Mosaic-GPU kernels, and prints a table last.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (role, mode, dtype, out dtype, a_major, b_major, c_major, tile_n)
BINS = [
    ("fwd", "ragged_m", "bfloat16", "bfloat16", "k", "n", "n", 256),
    ("fwd", "ragged_m", "bfloat16", "bfloat16", "k", "n", "n", 128),
    ("dlhs", "ragged_m", "bfloat16", "bfloat16", "k", "k", "n", 256),
    ("dlhs", "ragged_m", "bfloat16", "bfloat16", "k", "k", "n", 128),
    ("drhs", "ragged_k", "bfloat16", "bfloat16", "m", "n", "n", 256),
    ("drhs", "ragged_k", "bfloat16", "bfloat16", "m", "n", "n", 128),
    ("fwd16", "ragged_m", "float16", "float16", "k", "n", "n", 256),
    ("fwd32", "ragged_m", "bfloat16", "float32", "k", "n", "n", 128),
    ("fwdmA", "ragged_m", "bfloat16", "bfloat16", "m", "n", "n", 128),
    ("drhs32", "ragged_k", "bfloat16", "float32", "m", "n", "n", 256),
    ("drhsT", "ragged_k", "float16", "float16", "m", "n", "m", 128),
]


def _name(b):
    return f"{b[0]}_{b[1]}_{b[2]}_{b[3]}_{b[4]}{b[5]}{b[6]}_n{b[7]}"


def cmd_build(out):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from jax_cute.kernels import build, sm90_grouped as fam
    from jax_cute.kernels.gemm_spec import GroupedSpec
    os.makedirs(out, exist_ok=True)
    index = []
    for b in BINS:
        role, mode, dt, cdt, am, bm, cm, tn = b
        spec = GroupedSpec(mode, dt, dt, cdt, a_major=am, b_major=bm, c_major=cm)
        cfg = fam.Config(tile_n=tn)
        t = time.time()
        kb = build.compile_launcher(fam.launcher(spec, cfg), fam.signature(spec, cfg), arch=fam.ARCH,
                                    name=f"{fam.FAMILY}.{spec.key()}.{cfg.key()}")
        build.save_binary(kb, os.path.join(out, _name(b)))
        index.append(dict(file=_name(b), role=role, mode=mode, dtype=dt, out_dtype=cdt, a_major=am,
                          b_major=bm, c_major=cm, tile_n=tn, version=fam.VERSION))
        print(f"built {_name(b)} in {time.time() - t:.1f}s")
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
        from jax_cute.kernels import build
        with open(os.path.join(bins, "index.json")) as f:
            self.index = json.load(f)
        self.bin = {e["file"]: build.load_binary(os.path.join(bins, e["file"])) for e in self.index}

    def find(self, role, tile_n):
        for e in self.index:
            if e["role"] == role and e["tile_n"] == tile_n:
                return e
        return None

    def call(self, e, a, b, gs):
        """Physical arrays: ragged_m: a (La,M,K) [k-major] or (La,K,M) [m-major]; b (Lb,G,K,N)
        [n-major] or (Lb,G,N,K) [k-major]; ragged_k: a (La,T,Km), b (Lb,T,N). gs (Lg,G)."""
        import jax
        import jax.numpy as jnp
        from jax_cute.launch import kernel_call
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


def run_checks(r, rng):
    import numpy as np
    import jax
    import jax.numpy as jnp
    os.environ["JAX_CUTE_NAN_FILL"] = "1"  # outputs start as NaN: unwritten elements show
    results = []

    def rnd(shape, dt):
        x = rng.standard_normal(shape).astype(np.float32)
        return jnp.asarray(x, dt)

    def check(label, e, a, b, gs, ref_fn, tol):
        try:
            f = jax.jit(lambda a, b, gs: r.call(e, a, b, gs))
            out = np.asarray(f(a, b, gs).astype(jnp.float32))
            err = _rel_err(out, ref_fn())
            ok = err <= tol
        except Exception as ex:  # keep going: report every case
            err, ok = repr(ex)[:200], False
        results.append((label, e["file"], ok, err))
        print(f"{'PASS' if ok else 'FAIL'} {label:<44} {e['file']:<44} err={err}", flush=True)

    def tol_of(e):
        return 1e-5 if e["out_dtype"] == "float32" else 1e-2

    # ragged_m: forward (b n-major), lhs gradient (b k-major), fp16, fp32 out, m-major A
    shapes_m = [(1000, 200, 264, 7), (4096, 512, 1024, 16), (257, 64, 136, 33), (2048, 128, 512, 64)]
    for e in r.index:
        if e["mode"] != "ragged_m":
            continue
        dt = jnp.dtype(e["dtype"])
        for (M, K, N, G) in shapes_m:
            if e["a_major"] == "m" and M % 8:
                M += 8 - M % 8
            for kind in ("uniform", "skewed", "empty", "short", "over", "negative", "huge"):
                if kind == "empty" and G < 3:
                    continue
                s = _sizes(rng, kind, G, M)[None]
                a_log = rnd((1, M, K), dt)
                b_log = rnd((1, G, N, K), dt)
                a_phys = a_log if e["a_major"] == "k" else jnp.swapaxes(a_log, 1, 2)
                b_phys = b_log if e["b_major"] == "k" else jnp.swapaxes(b_log, 2, 3)
                check(f"m {M}x{K}x{N} G{G} {kind}", e, a_phys, b_phys, jnp.asarray(s),
                      lambda: ref_ragged_m(np.asarray(a_log.astype(jnp.float32)),
                                           np.asarray(b_log.astype(jnp.float32)), s), tol_of(e))
            if (M, K, N, G) != shapes_m[0]:
                continue
            # batches: L=3 with B broadcast (L=1) and per-batch group sizes
            L = 3
            s = np.stack([_sizes(rng, k, G, M) for k in ("uniform", "skewed", "short")])
            a_log, b_log = rnd((L, M, K), dt), rnd((1, G, N, K), dt)
            a_phys = a_log if e["a_major"] == "k" else jnp.swapaxes(a_log, 1, 2)
            b_phys = b_log if e["b_major"] == "k" else jnp.swapaxes(b_log, 2, 3)
            check(f"m {M}x{K}x{N} G{G} L3 bcast-b", e, a_phys, b_phys, jnp.asarray(s),
                  lambda: ref_ragged_m(np.asarray(a_log.astype(jnp.float32)),
                                       np.asarray(b_log.astype(jnp.float32)), s), tol_of(e))

    # ragged_k (rhs gradient): out[g] = lhs[rows of g]^T . dout[rows of g]
    shapes_k = [(1000, 200, 264, 7), (4096, 512, 1024, 16), (259, 64, 136, 33), (2048, 128, 512, 64)]
    for e in r.index:
        if e["mode"] != "ragged_k":
            continue
        dt = jnp.dtype(e["dtype"])
        for (T, Km, N, G) in shapes_k:
            for kind in ("uniform", "skewed", "empty", "short", "over", "negative", "huge"):
                s = _sizes(rng, kind, G, T)[None]
                a, b = rnd((1, T, Km), dt), rnd((1, T, N), dt)
                check(f"k {T}x{Km}x{N} G{G} {kind}", e, a, b, jnp.asarray(s),
                      lambda: ref_ragged_k(np.asarray(a.astype(jnp.float32)),
                                           np.asarray(b.astype(jnp.float32)), s), tol_of(e))
            if (T, Km, N, G) != shapes_k[0]:
                continue
            L = 2
            s = np.stack([_sizes(rng, k, G, T) for k in ("skewed", "empty")])
            a, b = rnd((L, T, Km), dt), rnd((1, T, N), dt)
            check(f"k {T}x{Km}x{N} G{G} L2 bcast-b", e, a, b, jnp.asarray(s),
                  lambda: ref_ragged_k(np.asarray(a.astype(jnp.float32)),
                                       np.asarray(b.astype(jnp.float32)), s), tol_of(e))

    # replay: one jitted function, new group sizes on each call (must not be baked in)
    for role in ("fwd", "drhs"):
        e = r.find(role, 256)
        dt = jnp.dtype(e["dtype"])
        M, K, N, G = 3000, 256, 512, 12
        if role == "fwd":
            a, b = rnd((1, M, K), dt), rnd((1, G, K, N), dt)
            ref = lambda s: ref_ragged_m(np.asarray(a.astype(jnp.float32)),
                                         np.asarray(jnp.swapaxes(b, 2, 3).astype(jnp.float32)), s)
        else:
            a, b = rnd((1, M, K), dt), rnd((1, M, N), dt)
            ref = lambda s: ref_ragged_k(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), s)
        f = jax.jit(lambda a, b, gs: r.call(e, a, b, gs))
        for i, kind in enumerate(("uniform", "skewed", "empty", "short", "skewed")):
            s = _sizes(rng, kind, G, M)[None]
            out = np.asarray(f(a, b, jnp.asarray(s)).astype(jnp.float32))
            err = _rel_err(out, ref(s))
            ok = err <= 1e-2
            results.append((f"replay {role} #{i} {kind}", e["file"], ok, err))
            print(f"{'PASS' if ok else 'FAIL'} replay {role} #{i} {kind} err={err}", flush=True)
    os.environ["JAX_CUTE_NAN_FILL"] = "0"
    return results


def _time(f, *args, reps=10, batches=7):
    """Median over batches of (time of `reps` back-to-back async calls) / reps, in seconds."""
    import numpy as np
    out = f(*args)
    out.block_until_ready()
    ts = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(reps):
            out = f(*args)
        out.block_until_ready()
        ts.append((time.perf_counter() - t) / reps)
    return float(np.median(ts))


def run_bench(r, rng):
    import numpy as np
    import jax
    import jax.numpy as jnp
    os.environ["JAX_CUTE_NAN_FILL"] = "0"
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except Exception as ex:  # noqa: BLE001
        print("pallas kernels unavailable:", ex)
        ragged_dot_mgpu = transposed_ragged_dot_mgpu = None
    rows = []
    shapes = [(8, 16384, 4096, 14336), (64, 32768, 2048, 1408), (16, 16384, 2048, 16384), (128, 16384, 4096, 1536)]
    dt = jnp.bfloat16
    for (G, M, K, N) in shapes:
        lhs = jnp.asarray(rng.standard_normal((M, K), np.float32), dt)
        rhs = jnp.asarray(rng.standard_normal((G, K, N), np.float32), dt)
        dout = jnp.asarray(rng.standard_normal((M, N), np.float32), dt)
        for kind in ("uniform", "skewed"):
            s = jnp.asarray(_sizes(rng, kind, G, M))
            flops = 2.0 * M * K * N
            row = {"shape": f"G{G} M{M} K{K} N{N}", "sizes": kind}
            # forward
            for tn in (256, 128):
                e = r.find("fwd", tn)
                f = jax.jit(lambda a, b, gs, e=e: r.call(e, a[None], b[None], gs[None]))
                row[f"fwd n{tn}"] = flops / _time(f, lhs, rhs, s) / 1e12
            f = jax.jit(lambda a, b, gs: jax.lax.ragged_dot(a, b, gs))
            row["fwd xla"] = flops / _time(f, lhs, rhs, s, reps=2, batches=3) / 1e12
            best = 0.0
            if ragged_dot_mgpu is not None:
                for kw in (dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1),
                           dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=8)):
                    try:
                        f = jax.jit(lambda a, b, gs, kw=kw: ragged_dot_mgpu.ragged_dot(a, b, group_sizes=gs, **kw))
                        best = max(best, flops / _time(f, lhs, rhs, s) / 1e12)
                    except Exception:  # noqa: BLE001  (config not valid for this shape)
                        pass
            row["fwd pallas"] = best
            # rhs gradient
            for tn in (256, 128):
                e = r.find("drhs", tn)
                f = jax.jit(lambda a, b, gs, e=e: r.call(e, a[None], b[None], gs[None]))
                row[f"drhs n{tn}"] = flops / _time(f, lhs, dout, s) / 1e12
            best = 0.0
            if transposed_ragged_dot_mgpu is not None:
                for kw in (dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1),):
                    try:
                        f = jax.jit(lambda a, b, gs, kw=kw: transposed_ragged_dot_mgpu.transposed_ragged_dot(
                            a, b, group_sizes=gs, **kw))
                        best = max(best, flops / _time(f, lhs, dout, s) / 1e12)
                    except Exception:  # noqa: BLE001
                        pass
            row["drhs pallas"] = best
            print(row, flush=True)
            rows.append(row)
    return rows


def cmd_run(bins, skip_bench=False):
    import numpy as np
    import jax
    print("devices:", jax.devices())
    r = Runner(bins)
    rng = np.random.default_rng(int(time.time()) % 2**31)
    results = run_checks(r, rng)
    rows = [] if skip_bench else run_bench(r, rng)
    bad = [x for x in results if not x[2]]
    print(f"\n== correctness: {len(results) - len(bad)}/{len(results)} pass")
    for x in bad[:40]:
        print("  FAIL", x)
    if rows:
        cols = ["fwd n256", "fwd n128", "fwd xla", "fwd pallas", "drhs n256", "drhs n128", "drhs pallas"]
        print("\n== TFLOP/s (bf16, median)")
        print(f"{'shape':<26}{'sizes':<9}" + "".join(f"{c:>12}" for c in cols))
        for row in rows:
            print(f"{row['shape']:<26}{row['sizes']:<9}" + "".join(f"{row[c]:>12.1f}" for c in cols))
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    rr = sub.add_parser("run")
    rr.add_argument("--bins", required=True)
    rr.add_argument("--no-bench", action="store_true")
    args = p.parse_args()
    if args.cmd == "build":
        cmd_build(args.out)
    else:
        sys.exit(cmd_run(args.bins, args.no_bench))


if __name__ == "__main__":
    main()

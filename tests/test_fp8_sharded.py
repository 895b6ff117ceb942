"""Block-scaled fp8 products on a mesh of 8 CPU devices: the dense product's partitioning rules
(scales sharded with their blocks: data-parallel M, model-parallel N, a sharded K summed), a
dimension that does not split into whole blocks replicated with a log line, and training steps
sharded against the same step on one device: an fp8 MLP and an fp8 MoE layer, and a kernelized
layer stack under scan, whose weights are quantized before it (on whole blocks a shard, and on
weights whose shards hold part blocks).

The devices must be set before JAX starts, so this file runs itself in a subprocess
(``python tests/test_fp8_sharded.py``) that prints its results as JSON.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import shared_result  # tests/ is on sys.path: under pytest, and run as a script

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")


def _worker() -> dict:
    import contextlib
    import dataclasses
    import functools
    import logging

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_cute
    from jax_cute.fp8 import BlockScaled, grouped_linear, linear

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("jax_cute").addHandler(Keep())
    logging.getLogger("jax_cute").propagate = False
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    out: dict = {}

    def put(q: BlockScaled, spec):
        return jax.tree.map(lambda v: jax.device_put(v, NamedSharding(mesh, spec)), q)

    def counts(text: str) -> dict:
        return {c: text.count(f"{c}(") + text.count(f"{c}-start(") for c in COLLECTIVES}

    f = jax.jit(lambda a, b: jax_cute.matmul(a, b, preferred_element_type=jnp.float32))
    for name, (m, k, n), xs, ws in [("dp_tp", (256, 512, 1024), P("data", None), P(None, "model")),
                                    ("k_sharded", (256, 512, 1024), P(None, "model"), P("model", None)),
                                    ("n_not_whole_blocks", (256, 512, 1000), P("data", None), P(None, "model"))]:
        x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
        xq, wq = jax_cute.quantize(x), jax_cute.quantize(w, "128x128")
        ref = np.asarray(f(xq, wq))
        del messages[:]
        a, b = put(xq, xs), put(wq, ws)
        res = f(a, b)
        out[name] = {"err": float(np.max(np.abs(np.asarray(res) - ref)) / np.max(np.abs(ref))),
                     "spec": [None if s is None else str(s) for s in res.sharding.spec],
                     "collectives": counts(f.lower(a, b).compile().as_text()),
                     "replicated_log": [s for s in messages if "replicated" in s]}

    # swiglu pairs column j with j + N/2: N stays whole even when the weight is sharded along it
    x, w = rng.standard_normal((256, 256)).astype(np.float32), rng.standard_normal((256, 1024)).astype(np.float32)
    xq, wq = jax_cute.quantize(x), jax_cute.quantize(w, "128x128")
    sw = jax.jit(lambda a, b: jax_cute.matmul(a, b, activation="swiglu", preferred_element_type=jnp.float32))
    ref = np.asarray(sw(xq, wq))
    del messages[:]
    res = np.asarray(sw(put(xq, P("data", None)), put(wq, P(None, "model"))))
    out["swiglu"] = {"err": float(np.max(np.abs(res - ref)) / np.max(np.abs(ref))),
                     "replicated_log": [s for s in messages if "replicated" in s]}

    # grouped over M: tokens over data (each shard its groups clipped to its rows), N over model;
    # then K over model (summed), with a bias and an activation after the sum
    x, w = rng.standard_normal((256, 512)).astype(np.float32), rng.standard_normal((4, 512, 512)).astype(np.float32)
    bias = jnp.asarray(rng.standard_normal((4, 512)), jnp.float32)
    sizes = jnp.asarray([70, 0, 100, 50], jnp.int32)  # 36 rows past the last group
    xq, wq = jax_cute.quantize(x), jax_cute.quantize(w, "128x128")
    rd = jax.jit(lambda a, b, s, c: jax_cute.ragged_dot(a, b, s, bias=c, activation="gelu",
                                                        preferred_element_type=jnp.float32))
    ref = np.asarray(rd(xq, wq, sizes, bias))
    for name, xs, ws in [("ragged_dp_tp", P("data", None), P(None, None, "model")),
                         ("ragged_k_sharded", P("data", "model"), P(None, "model", None))]:
        a, b = put(xq, xs), put(wq, ws)
        res = rd(a, b, sizes, bias)
        out[name] = {"err": float(np.max(np.abs(np.asarray(res) - ref)) / np.max(np.abs(ref))),
                     "spec": [None if s is None else str(s) for s in res.sharding.spec],
                     "collectives": counts(rd.lower(a, b, sizes, bias).compile().as_text())}

    # grouped over K (the grouped weight gradient): P over model and T over data, each shard's
    # partial sums summed. Group-aligned, each shard takes its groups' blocks; in the natural
    # layout a block may straddle two shards (tokens 429-556 of group 3 over the shards of 500),
    # or, T over all 8 devices (shards of 125 tokens), several, and the last shard holds none
    # of a group's tokens
    from jax_cute.fp8 import quantize_grouped, ragged_k_dot, scaled, scaled_sharding
    from jax_cute.fp8.ops import ragged_k_dot_aligned
    from jax_cute.fp8.quantize import clipped_sizes, group_ends

    t, ks = 1000, jnp.asarray([300, 0, 129, 500], jnp.int32)   # 71 tokens past the last group
    qa, qb = (quantize_grouped(jnp.asarray(rng.standard_normal((r, t)), jnp.float32), ks) for r in (384, 520))
    nb = qa.scales.shape[1] + 1   # 12 blocks: whole blocks on each of 2 shards
    aligned = [(scaled.group_aligned(q.values, ks, nb), jnp.pad(q.scales, ((0, 0), (0, 1)), constant_values=1.0))
               for q in (qa, qb)]
    rk = jax.jit(lambda a, b: ragged_k_dot(a, b, ks))
    rka = jax.jit(lambda a, b: ragged_k_dot_aligned(a, b, clipped_sizes(group_ends(ks, t))))
    ref = np.asarray(rk(qa, qb))
    sharded = lambda xs, vs, ss: [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(xs, (vs, ss))]  # noqa: E731
    for name, fn, args in [
            ("ragged_k_natural", rk, [dataclasses.replace(q, values=v, scales=sc) for q, (v, sc) in
                                      ((qa, sharded((qa.values, qa.scales), P("model", "data"), P("model", None))),
                                       (qb, sharded((qb.values, qb.scales), P(None, "data"), P())))]),
            ("ragged_k_natural_8", rk, [dataclasses.replace(q, values=v, scales=sc) for q, (v, sc) in
                                        ((qa, sharded((qa.values, qa.scales), P(None, ("data", "model")), P())),
                                         (qb, sharded((qb.values, qb.scales), P(None, ("data", "model")), P())))]),
            ("ragged_k_aligned", rka, [tuple(sharded(aligned[0], P("model", "data"), P("model", "data"))),
                                       tuple(sharded(aligned[1], P(None, "data"), P(None, "data")))])]:
        del messages[:]
        res = fn(*args)
        out[name] = {"err": float(np.max(np.abs(np.asarray(res) - ref)) / np.max(np.abs(ref))),
                     "spec": [None if s is None else str(s) for s in res.sharding.spec],
                     "collectives": counts(fn.lower(*args).compile().as_text()),
                     "replicated_log": [s for s in messages if "replicated" in s]}

    # lowered for sm_90a, a shard of the call (P over model, T over data) runs the kernel on its
    # blocks (natural layout: laid out group-aligned first), then the sum: the rule's per-shard
    # function, traced as the partitioner traces it (shard_map stands in for its mesh context)
    from jax_cute import config

    sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))  # noqa: E731
    out["ragged_k_shard_lowering"] = {}
    for layout, t, nb in (("aligned", 2048, 16), ("natural", 2048, 19)):
        ts = "data" if layout == "aligned" else None   # (19 natural scale blocks: T whole)
        shapes = [sds((512, t), jnp.float8_e4m3fn, P("model", "data")), sds((512, nb), jnp.float32, P("model", ts)),
                  sds((256, t), jnp.float8_e4m3fn, P(None, "data")), sds((256, nb), jnp.float32, P(None, ts)),
                  sds((4,), jnp.int32, P())]
        params = {"out_dtype": "bfloat16", "compute": "float32", "aligned": layout == "aligned", "cuda": True}
        call = scaled_sharding.Call(tuple(sorted(params.items())), scaled._local)
        _, lower_fn, out_sh, arg_sh = scaled_sharding._ragged_k_partition(call, mesh, shapes, None)
        per_shard = jax.shard_map(lower_fn, mesh=mesh, in_specs=tuple(s.spec for s in arg_sh),
                                  out_specs=out_sh.spec, check_vma=False)
        with config.override(target_arch="sm_90a"):
            text = jax.jit(per_shard).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        out["ragged_k_shard_lowering"][layout] = {"launches": text.count("@jax_cute_launch"),
                                                  "sums": text.count("all_reduce"),
                                                  "specs": [list(s.spec) for s in arg_sh]}

    # a training step: fp8 MLP (tensor parallel over model, batch over data) and fp8 MoE (data)
    d, ff, g = 256, 512, 4
    params = {"w1": jnp.asarray(rng.standard_normal((d, ff)) * 0.05, jnp.float32),
              "w2": jnp.asarray(rng.standard_normal((ff, d)) * 0.05, jnp.float32),
              "e1": jnp.asarray(rng.standard_normal((g, d, 256)) * 0.05, jnp.float32)}
    tokens = jnp.asarray(rng.standard_normal((256, d)), jnp.float32)
    sizes = jnp.asarray([100, 20, 0, 136], jnp.int32)

    def loss(p, x):
        h = jax.nn.gelu(linear(x.astype(jnp.bfloat16), p["w1"].astype(jnp.bfloat16), out_dtype=jnp.float32))
        y = linear(h.astype(jnp.bfloat16), p["w2"].astype(jnp.bfloat16), out_dtype=jnp.float32)
        e = grouped_linear(y.astype(jnp.bfloat16), p["e1"].astype(jnp.bfloat16), sizes, out_dtype=jnp.float32)
        return jnp.mean(y ** 2) + jnp.mean(e ** 2)

    def sharded_step(step, params, specs, tokens) -> tuple[dict, dict, tuple]:
        """The step's loss and gradient errors with params sharded by ``specs`` and the tokens over
        data, against one device; the sharded gradients; the sharded arguments."""
        want_val, want = step(params, tokens)
        sp = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        st = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
        val, grads = step(sp, st)
        return ({"loss_err": abs(float(val) - float(want_val)) / abs(float(want_val)),
                 # norm-relative: a partial sum summed in another order may move a value across an
                 # fp8 rounding boundary downstream (one e4m3 step, 6 %), so no elementwise bound
                 "grad_err": {k: float(jnp.linalg.norm(grads[k] - want[k]) / jnp.linalg.norm(want[k]))
                              for k in params}}, grads, (sp, st))

    out["train"], grads, _ = sharded_step(jax.jit(jax.value_and_grad(loss)), params,
                                          {"w1": P(None, "model"), "w2": P("model", None), "e1": P()}, tokens)
    out["train"]["w1_grad_spec"] = [None if s is None else str(s) for s in grads["w1"].sharding.spec]

    # an fp8 MoE layer's weight gradient on Auto mesh axes, tokens over data and experts' N over
    # model: under jax.set_mesh, or with no mesh in context on arrays placed on the mesh (their
    # types carry it), each shard quantizes and contracts its own tokens, the blocks' amax and
    # the partial gradients summed; where no trace-time type names the mesh (jit's in_shardings
    # on host arrays) the group-aligned layout takes them whole (every device's activations
    # all-reduced into it, in float32)
    import re

    xm = jnp.asarray(rng.standard_normal((512, 384)), jnp.float32)
    em = jnp.asarray(rng.standard_normal((4, 384, 512)) * 0.05, jnp.float32)
    msizes = jnp.asarray([200, 0, 129, 150], jnp.int32)
    mshard = (NamedSharding(mesh, P(None, None, "model")), NamedSharding(mesh, P("data", None)))
    dw = lambda **kw: jax.jit(jax.grad(lambda w, x: jnp.mean(grouped_linear(x, w, msizes, out_dtype=jnp.float32) ** 2)), **kw)  # noqa: E731
    want_dw = dw()(em, xm)
    placed = tuple(jax.device_put(a, s) for a, s in zip((em, xm), mshard))
    out["auto_moe"] = {}
    for name, ctx, make, margs in (("set_mesh", lambda: jax.set_mesh(mesh), dw, placed),
                                   ("placed", contextlib.nullcontext, dw, placed),
                                   ("in_shardings", contextlib.nullcontext, lambda: dw(in_shardings=mshard), (em, xm))):
        with ctx():
            fn = make()
            got = fn(*margs)
            compiled = fn.lower(*margs).compile()
        out["auto_moe"][name] = {
            "err": float(jnp.linalg.norm(got - want_dw) / jnp.linalg.norm(want_dw)),
            "spec": [None if a is None else str(a) for a in got.sharding.spec],
            "x_spec": [None if a is None else str(a) for a in compiled.input_shardings[0][1].spec],
            "collectives": counts(compiled.as_text()),
            "reduced": sorted(shape for line in compiled.as_text().splitlines() if " all-reduce(" in line
                              for shape in re.findall(r"f32\[([\d,]+)\]", line.split(" all-reduce(")[0]))}

    # the fp8 layers inside shard_map (data parallel over 8 devices, weights replicated), with
    # check_vma (its default: the replicated weights' gradients summed over the devices, as JAX
    # transposes its own ops) and without (summed by hand)
    dmesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sx = jnp.asarray(rng.standard_normal((8 * 128, 128)), jnp.float32)
    sw = {"g": jnp.asarray(rng.standard_normal((4, 128, 256)) * 0.05, jnp.float32),
          "d": jnp.asarray(rng.standard_normal((128, 256)) * 0.05, jnp.float32)}
    ssizes = jnp.asarray([30, 0, 29, 50], jnp.int32)

    def shard_loss(p, xx):
        return (jnp.mean(grouped_linear(xx, p["g"], ssizes, out_dtype=jnp.float32) ** 2)
                + jnp.mean(linear(xx, p["d"], out_dtype=jnp.float32) ** 2))

    want_sm = jax.jit(jax.grad(lambda p: sum(shard_loss(p, sx[i * 128:(i + 1) * 128]) for i in range(8))))(sw)
    out["shard_map_vma"] = {}
    for vma in (True, False):
        body = ((lambda p, xx: jax.grad(shard_loss)(p, xx)) if vma else
                (lambda p, xx: jax.lax.psum(jax.grad(shard_loss)(p, xx), "d")))
        got = jax.jit(jax.shard_map(body, mesh=dmesh, in_specs=(P(), P("d")), out_specs=P(), check_vma=vma))(sw, sx)
        out["shard_map_vma"][str(vma)] = {k: float(jnp.linalg.norm(got[k] - want_sm[k]) / jnp.linalg.norm(want_sm[k]))
                                          for k in got}

    # kernelize(fp8=...) of a scanned layer stack, its weights sharded over model and the tokens
    # over data: the stacks quantized before the scan as on one device (scanned_stack)
    import scanned_stack
    p, x, _ = scanned_stack.case(False, layers=2, d=512, f=1024, tokens=256, sizes=())   # (whole blocks a shard)
    g = jax.jit(jax.value_and_grad(jax_cute.kernelize(scanned_stack.loss, fp8="blockwise")))
    out["scanned"], _, args = sharded_step(
        g, p, {"w1": P(None, None, "model"), "w2": P(None, None, "model"), "shared": P(None, "model")}, x)
    out["scanned"]["calls"] = scanned_stack.weight_kernel_calls(jax.make_jaxpr(g)(*args))

    # the same with d=256: 2 scale blocks on the 4-way model axis, so the quantizer's reshape
    # would shard the block axis with a sub-axis of model; replicated instead, with a log line
    p, x, _ = scanned_stack.case(False, layers=2, d=256, f=512, tokens=256, sizes=())
    del messages[:]
    out["split_blocks"], _, _ = sharded_step(
        g, p, {"w1": P(None, None, "model"), "w2": P(None, "model", None), "shared": P(None, "model")}, x)
    out["split_blocks"]["replicated_log"] = sorted({s for s in messages if "replicated" in s})

    # the same stack with experts (ragged_dot), their weights sharded over model along f and the
    # tokens over data: grouped over M forward and dgrad, the ragged-K weight gradient
    sizes = (100, 0, 56, 100)
    p, x, gs = scanned_stack.case(True, layers=2, d=256, f=512, tokens=256, sizes=sizes)
    moe = jax.jit(jax.value_and_grad(jax_cute.kernelize(lambda p, x: scanned_stack.loss(p, x, gs), fp8="blockwise")))
    out["moe_scanned"], _, _ = sharded_step(
        moe, p, {"w1": P(None, None, None, "model"), "w2": P(None, None, None, "model"), "shared": P()}, x)

    # sharding in types (Explicit mesh axes): quantization, products typed as their rules shard
    # them, and the training layers' gradients typed as their primals
    emesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    same = lambda a, b: all(np.array_equal(np.asarray(u), np.asarray(v))  # noqa: E731
                            for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    typed = lambda x: [None if a is None else str(a) for a in jax.typeof(x).sharding.spec]  # noqa: E731
    x = jnp.asarray(rng.standard_normal((512, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 1024)) * 0.05, jnp.float32)
    w_odd = jnp.asarray(rng.standard_normal((256, 1000)) * 0.05, jnp.float32)
    mm = jax.jit(lambda a, b: jax_cute.matmul(jax_cute.quantize(a), jax_cute.quantize(b, "128x128"),
                                              preferred_element_type=jnp.float32))
    mlp = jax.jit(jax.value_and_grad(
        lambda p, x: jnp.mean(linear(jax.nn.gelu(linear(x, p["w1"], out_dtype=jnp.float32)), p["w2"],
                                     out_dtype=jnp.float32) ** 2)))
    mlp_params = {"w1": w, "w2": jnp.asarray(rng.standard_normal((1024, 256)) * 0.05, jnp.float32)}
    moe = jax.jit(jax.grad(lambda w, x: jnp.mean(grouped_linear(x, w, sizes, out_dtype=jnp.float32) ** 2)))
    e1 = jnp.asarray(rng.standard_normal((4, 256, 512)) * 0.05, jnp.float32)
    sp, sx, _ = scanned_stack.case(False, layers=2, d=256, f=512, tokens=256, sizes=())
    stack = jax.jit(jax.value_and_grad(jax_cute.kernelize(scanned_stack.loss, fp8="blockwise")))
    # an MoE layer written for Explicit axes: lax.ragged_dot needs out_sharding there (and JAX's
    # own gradient of it has no rule yet); kernelize takes those products, bf16 and fp8
    experts = {"w1": e1, "w2": jnp.asarray(rng.standard_normal((4, 512, 256)) * 0.05, jnp.float32)}

    routed = jnp.asarray([200, 0, 112, 150], jnp.int32)   # of 512 tokens

    def moe_layer(p, x, rows=None):
        h = jax.nn.gelu(jax.lax.ragged_dot(x.astype(jnp.bfloat16), p["w1"].astype(jnp.bfloat16), routed,
                                           preferred_element_type=jnp.float32, out_sharding=rows))
        return jnp.mean(jax.lax.ragged_dot(h.astype(jnp.bfloat16), p["w2"].astype(jnp.bfloat16), routed,
                                           preferred_element_type=jnp.float32, out_sharding=rows) ** 2)

    kernelized = {fp8: jax_cute.kernelize(functools.partial(moe_layer, rows=P("data", None)), fp8=fp8)
                  for fp8 in (None, "blockwise")}
    layer = {fp8: jax.jit(jax.value_and_grad(k)) for fp8, k in kernelized.items()}
    want = {"mm": mm(x, w), "mlp": mlp(mlp_params, x), "moe": moe(e1, x), "stack": stack(sp, sx)}
    one = jax.make_mesh((1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                        devices=jax.devices()[:1])
    with jax.set_mesh(one):   # the same program on one device
        want.update({("layer", fp8): jax.tree.map(np.asarray, f(experts, x)) for fp8, f in layer.items()})
    with jax.set_mesh(emesh):
        xs, ws, wo = (jax.device_put(a, s) for a, s in ((x, P("data", None)), (w, P(None, "model")),
                                                        (w_odd, P(None, "model"))))
        qs = {"x": jax.jit(lambda a: jax_cute.quantize(a))(xs), "w": jax.jit(lambda a: jax_cute.quantize(a, "128x128"))(ws),
              "w_odd": jax.jit(lambda a: jax_cute.quantize(a, "128x128"))(wo)}
        y = mm(xs, ws)
        ps = {"w1": ws, "w2": jax.device_put(mlp_params["w2"], P("model", None))}
        loss, grads = mlp(ps, xs)
        es = jax.device_put(e1, P(None, None, "model"))
        de = moe(es, xs)
        # kernelize(fp8=...) of the layer stack, data parallel (sharding the weights along f would
        # make the model's own w2.T product ambiguous on Explicit axes)
        stack_loss, stack_grads = stack(sp, jax.device_put(sx, P("data", None)))
        layer_out = {fp8: f(experts, xs) for fp8, f in layer.items()}
        out["explicit"] = {
            "quantized": {k: same(q, jax_cute.quantize(a, "1x128" if k == "x" else "128x128"))
                          for (k, q), a in zip(qs.items(), (x, w, w_odd))},
            "quantized_types": {k: [typed(q.values), typed(q.scales)] for k, q in qs.items()},
            "mm": {"same": same(y, want["mm"]), "type": typed(y),
                   "collectives": counts(mm.lower(xs, ws).compile().as_text())},
            "mlp": {"loss_err": abs(float(loss) - float(want["mlp"][0])) / abs(float(want["mlp"][0])),
                    "grad_err": {k: float(jnp.linalg.norm(grads[k] - want["mlp"][1][k]) / jnp.linalg.norm(want["mlp"][1][k]))
                                 for k in grads},
                    "grad_types": {k: typed(v) for k, v in grads.items()}},
            "moe": {"grad_err": float(jnp.linalg.norm(de - want["moe"]) / jnp.linalg.norm(want["moe"])),
                    "grad_type": typed(de), "collectives": counts(moe.lower(es, xs).compile().as_text())},
            "quantized_grouped": {str(spec): same(jax.jit(lambda a: quantize_grouped(a, ks))(jax.device_put(xk, spec)),
                                                  quantize_grouped(xk, ks))
                                  for xk in (jnp.asarray(rng.standard_normal((256, 1000)), jnp.float32),)
                                  for spec in (P(None, "data"), P("model", ("data",)), P(None, ("data", "model")))},
            "moe_layer": {str(fp8): {"loss_err": abs(float(v) - float(want[("layer", fp8)][0])) / abs(float(want[("layer", fp8)][0])),
                                     "grad_err": {k: float(jnp.linalg.norm(g[k] - want[("layer", fp8)][1][k])
                                                           / jnp.linalg.norm(want[("layer", fp8)][1][k])) for k in g},
                                     "epilogues": [p.epilogue for p in kernelized[fp8].report.products]}
                          for fp8, (v, g) in layer_out.items()},
            "stack": {"loss_err": abs(float(stack_loss) - float(want["stack"][0])) / abs(float(want["stack"][0])),
                      "grad_err": {k: float(jnp.linalg.norm(stack_grads[k] - want["stack"][1][k])
                                            / jnp.linalg.norm(want["stack"][1][k])) for k in stack_grads}}}

    # the operand quantizers (cute_call kernels, no partitioning rule), lowered for sm_90a: their
    # references where jit partitions them, the kernel inside shard_map (as on one device)
    from jax_cute.fp8 import wgrad_operands as wo

    x = jnp.asarray(rng.standard_normal((2048, 256)), jnp.bfloat16)
    q = lambda x: wo.quantize_rows_and_tokens(x)[1][0]  # noqa: E731
    sm = jax.shard_map(q, mesh=mesh, in_specs=P(("data", "model"), None), out_specs=P(None, ("data", "model")))
    with config.override(target_arch="sm_90a"):
        out["quantizer_launches"] = {
            name: jax.jit(fn).trace(a).lower(lowering_platforms=("cuda",)).as_text().count("@jax_cute_launch")
            for name, fn, a in (("partitioned", q, jax.device_put(x, NamedSharding(mesh, P("data", None)))),
                                ("shard_map", sm, jax.device_put(x, NamedSharding(mesh, P(("data", "model"), None)))))}
    return out


def _script(_=None) -> shared_result.Script:
    env = shared_result.host_devices_env(8)
    return shared_result.Script("test_fp8_sharded", [sys.executable, __file__], env=env, cwd=ROOT, timeout=600)


SUBPROCESS_FIXTURES = {"results": _script}  # (conftest starts it before the first test)


@pytest.fixture(scope="module")
def results() -> dict:
    return _script().result()


def test_quantizer_kernels_lower_to_their_references_when_partitioned(results):
    assert results["quantizer_launches"] == {"partitioned": 0, "shard_map": 1}


def test_data_and_model_parallel_dense_product(results):
    r = results["dp_tp"]
    assert r["err"] < 1e-6
    assert r["spec"] == ["data", "model"]
    assert not any(r["collectives"].values()), r  # every shard holds its blocks and their scales
    assert not r["replicated_log"]


def test_sharded_k_is_summed(results):
    r = results["k_sharded"]
    assert r["err"] < 1e-5
    assert r["collectives"]["all-reduce"] + r["collectives"]["reduce-scatter"] >= 1, r


def test_dimension_without_whole_blocks_is_replicated_with_a_message(results):
    r = results["n_not_whole_blocks"]
    assert r["err"] < 1e-6
    assert r["replicated_log"] and "N=1000" in r["replicated_log"][0] and "128" in r["replicated_log"][0]


def test_grouped_product_sharded_over_tokens_and_n(results):
    r = results["ragged_dp_tp"]
    assert r["err"] < 1e-6 and r["spec"] == ["data", "model"]
    assert not any(r["collectives"].values()), r
    r = results["ragged_k_sharded"]
    assert r["err"] < 1e-5 and r["collectives"]["all-reduce"] >= 1, r


def test_grouped_weight_gradient_sharded_over_its_rows_and_tokens(results):
    r = results["ragged_k_aligned"]   # P over model, T over data: summed
    assert r["err"] < 1e-6 and r["spec"] == [None, "model"], r
    assert r["collectives"]["all-reduce"] >= 1 and not r["collectives"]["all-gather"] and not r["replicated_log"], r
    r = results["ragged_k_shard_lowering"]   # on the GPU: each shard's kernel, then the sum
    assert all(v["launches"] == 1 and v["sums"] >= 1 for v in r.values()), r
    assert r["aligned"]["specs"][:4] == [["model", "data"]] * 2 + [[None, "data"]] * 2, r
    assert r["natural"]["specs"][:4] == [["model", "data"], ["model", None], [None, "data"], [None, None]], r
    for name, spec in (("ragged_k_natural", [None, "model"]), ("ragged_k_natural_8", [])):
        r = results[name]   # blocks from each group's first token: the straddling ones' parts summed
        assert r["err"] < 1e-6 and r["spec"] == spec, r
        assert r["collectives"]["all-reduce"] >= 1 and not r["collectives"]["all-gather"] and not r["replicated_log"], r


def test_gated_activation_keeps_n_whole(results):
    r = results["swiglu"]
    assert r["err"] < 1e-6
    assert any("gated activation" in s for s in r["replicated_log"]), r


def test_sharded_fp8_training_step(results):
    r = results["train"]
    assert r["loss_err"] < 1e-5 and max(r["grad_err"].values()) < 2e-3, r
    assert r["w1_grad_spec"] == [None, "model"]


def test_grouped_weight_gradient_keeps_tokens_on_auto_axes(results):
    """On Auto mesh axes, under jax.set_mesh or on arrays placed on the mesh with none in
    context, grouped_linear's weight gradient takes quantize_grouped's layout, whose rule
    quantizes each shard's tokens where they lie: only the blocks' amax and the partial
    gradients are summed over devices. Where the trace sees no mesh at all (jit's in_shardings
    on host arrays) the group-aligned layout takes every token (the activations all-reduced)."""
    r = results["auto_moe"]
    for v in r.values():
        assert v["err"] < 2e-3 and v["spec"] == [None, None, "model"], r
    # (7 scale blocks of 512 tokens in 4 groups; K 384; N 512 over 4 shards)
    for name in ("set_mesh", "placed"):
        assert r[name]["reduced"] == ["4,384,128", "7,128", "7,384"], r
        assert r[name]["x_spec"][:1] == ["data"] and not r[name]["collectives"]["all-gather"], r
    assert "896,384" in r["in_shardings"]["reduced"], r


def test_fp8_layers_inside_shard_map(results):
    """fp8.linear and grouped_linear inside shard_map train as one device does, with check_vma
    (their gradients typed as their primals: a replicated weight's summed over the devices) and
    without."""
    for errs in results["shard_map_vma"].values():
        assert max(errs.values()) < 1e-5, results["shard_map_vma"]


def test_sharded_scanned_stack_quantized_before_the_scan(results):
    r = results["scanned"]
    assert r["calls"] == {"0": 3}, r   # (JSON keys: strings)
    assert r["loss_err"] < 1e-5 and max(r["grad_err"].values()) < 2e-3, r


def test_sharded_moe_stack_in_fp8(results):
    r = results["moe_scanned"]
    assert r["loss_err"] < 1e-5 and max(r["grad_err"].values()) < 2e-3, r


def test_sharding_in_types(results):
    """On Explicit mesh axes: quantize keeps whole blocks a shard (a weight of 1000 columns over
    4 shards is quantized whole), quantize_grouped quantizes each shard's tokens (a block may
    straddle two), a scaled product's type is its rules' sharding, fp8.linear's and
    grouped_linear's gradients take their primals' types (grouped_linear's weight gradient
    without gathering the tokens), and a kernelized layer stack trains data parallel as on one
    device."""
    r = results["explicit"]
    assert all(r["quantized"].values()), r
    assert r["quantized_types"] == {"x": [["data", None], ["data", None]], "w": [[None, "model"], [None, "model"]],
                                    "w_odd": [[None, None], [None, None]]}, r
    assert r["mm"]["same"] and r["mm"]["type"] == ["data", "model"] and not any(r["mm"]["collectives"].values()), r
    assert r["mlp"]["loss_err"] < 1e-5 and max(r["mlp"]["grad_err"].values()) < 2e-3, r
    assert r["mlp"]["grad_types"] == {"w1": [None, "model"], "w2": ["model", None]}, r
    assert r["moe"]["grad_err"] < 2e-3 and r["moe"]["grad_type"] == [None, None, "model"], r
    # the tokens stay where they are: the weight gradient in quantize_grouped's layout, per shard
    assert not r["moe"]["collectives"]["all-gather"], r
    assert all(r["quantized_grouped"].values()), r   # each shard its tokens, bit for bit as one device
    assert r["stack"]["loss_err"] < 1e-5 and max(r["stack"]["grad_err"].values()) < 2e-3, r
    # lax.ragged_dot with out_sharding, kernelized, against the same program on one device: fp8
    # (its weight gradient summed over devices in float32), and bf16, whose sums over devices
    # round in bf16 (docs/sharding.md: 1.3e-3 here)
    for mode, bound in (("blockwise", 2e-3), ("None", 5e-3)):
        v = r["moe_layer"][mode]
        assert v["loss_err"] < 1e-5 and max(v["grad_err"].values()) < bound, r["moe_layer"]
        # gelu fused into the first product, its result resharded to gelu's type
        assert v["epilogues"][0] == "gelu" and not any(v["epilogues"][1:]), v


def test_scale_blocks_a_mesh_axis_would_split_are_replicated(results):
    r = results["split_blocks"]
    assert r["loss_err"] < 1e-5 and max(r["grad_err"].values()) < 2e-3, r
    assert any("N=256 does not split into 4 shards" in s for s in r["replicated_log"]), r


if __name__ == "__main__":
    print(json.dumps(_worker()))

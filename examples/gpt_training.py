"""Train a GPT-style decoder twice from the same start: as written, and through jax_cute.kernelize.

The model is plain JAX with optax: token and position embeddings, pre-norm blocks of causal
multi-head attention (``jnp.einsum``) and a GELU MLP, layers stacked under ``lax.scan`` with
``jax.checkpoint`` (saving only the fp8 weights an fp8 run quantizes in the body: kernelize
quantizes the stacks before the scan where its weight kernel takes them), a tied LM head.
Parameters are f32 master weights; every product runs in bf16 and returns f32
(``preferred_element_type``), as mixed-precision training does. AdamW.
``--moe`` replaces each MLP by a mixture of experts (top-2 of 8, tokens sorted by expert, two
``lax.ragged_dot``s). ``--fp8`` trains the kernelized run with block-scaled fp8 weight products
(``kernelize(loss, fp8=...)``: DeepSeek-V3's recipe, forward and both gradients; attention's
score and value products, the tied LM head and the router stay bf16), against the plain bf16 run.

``--mesh data=N[,model=M]`` trains on N x M devices: the batch is split over ``data`` (data
parallel; ``--fsdp`` also shards every weight over it, gathered per layer), the attention heads
and MLP width over ``model`` (tensor parallel: column- then row-parallel products), and with
``--moe`` the experts over every device (expert parallel: routing is a data-parallel product,
then the experts run in a ``shard_map`` with an all-to-all token dispatch). The sharded run
starts from the same parameters and batches as a one-device run and computes what it does up to
float32 rounding, so their loss curves agree (docs/sharding.md says what keeps them together).
With ``--distributed`` each process drives its own GPUs through ``jax.distributed`` (see the
README for the launch lines).

The kernelized step is ``jax.value_and_grad(jax_cute.kernelize(loss))``: the forward products
become jax_cute primitives and the gradients come from their autodiff rules, which round the
f32 cotangent once to bf16 so the gradient GEMMs run on the 16-bit kernels (XLA runs the plain
model's gradient products on the f32 cotangent). On a CPU both runs are plain XLA ops.

    python examples/gpt_training.py                 # tiny on CPU, h200 on a GPU
    python examples/gpt_training.py --size h200 --moe --steps 20
    python examples/gpt_training.py --size h200-wide --fp8 --steps 20
    python examples/gpt_training.py --mesh data=2,model=2 --moe
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_cute
from training_loop import compare_line, path_taken

COMPUTE = jnp.bfloat16
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    d_model: int
    heads: int
    layers: int
    seq: int
    batch: int
    moe: bool = False
    experts: int = 8
    top_k: int = 2
    lr: float = 3e-4

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def d_ff(self) -> int:  # dense MLP width; each expert is half as wide (top-2: the same FLOPs)
        return 4 * self.d_model if not self.moe else 2 * self.d_model


SIZES = {
    "tiny": Config(vocab=256, d_model=64, heads=2, layers=2, seq=32, batch=4, lr=3e-3),
    "h200": Config(vocab=32000, d_model=2048, heads=16, layers=4, seq=1024, batch=8, lr=3e-4),
    # a 7B-class width (4 layers of it): where fp8's weight products are most of the step
    "h200-wide": Config(vocab=32000, d_model=4096, heads=32, layers=4, seq=1024, batch=8, lr=3e-4),
}

Params = dict


# -- the model ----------------------------------------------------------------------------------

def init_params(key: jax.Array, cfg: Config) -> Params:
    d, f, n, e = cfg.d_model, cfg.d_ff, cfg.layers, cfg.experts
    ks = iter(jax.random.split(key, 8))
    normal = lambda shape, std: std * jax.random.normal(next(ks), shape, F32)  # noqa: E731
    layers = {"ln1": jnp.ones((n, d), F32), "ln2": jnp.ones((n, d), F32),
              "wqkv": normal((n, d, 3, cfg.heads, cfg.head_dim), d ** -0.5),
              "wo": normal((n, cfg.heads, cfg.head_dim, d), (2 * n * d) ** -0.5)}
    if cfg.moe:
        layers |= {"router": normal((n, d, e), d ** -0.5), "w1": normal((n, e, d, f), d ** -0.5),
                   "w2": normal((n, e, f, d), (2 * n * f) ** -0.5)}
    else:
        layers |= {"w1": normal((n, d, f), d ** -0.5), "w2": normal((n, f, d), (2 * n * f) ** -0.5)}
    return {"embed": normal((cfg.vocab, d), 0.02), "pos": normal((cfg.seq, d), 0.01),
            "ln_f": jnp.ones((d,), F32), "layers": layers}


def norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMS norm in f32, kept in f32: each product rounds its own copy to bf16, so the cotangents
    of a normed input used twice (an MoE's router and experts) are summed in f32."""
    x = x.astype(F32)
    return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def mm(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """A bf16 product with an f32 result."""
    return jnp.einsum(spec, a.astype(COMPUTE), b.astype(COMPUTE), preferred_element_type=F32)


def grouped_mm(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """A bf16 grouped product (rows of ``x`` in groups of ``sizes``, each by its ``w``) with an
    f32 result."""
    return lax.ragged_dot(x.astype(COMPUTE), w.astype(COMPUTE), sizes, preferred_element_type=F32)


def attention(p: Params, x: jax.Array, cfg: Config) -> jax.Array:
    t = x.shape[1]
    qkv = mm("btd,dche->btche", x, p["wqkv"]).astype(COMPUTE)  # heads kept as an axis: shardable
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = mm("bthd,bshd->bhts", q, k) * cfg.head_dim ** -0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    out = mm("bhts,bshd->bthd", probs, v)
    return mm("bthd,hde->bte", out, p["wo"])


def mlp(p: Params, x: jax.Array, cfg: Config, mesh: Mesh | None = None) -> jax.Array:
    return mm("btf,fd->btd", jax.nn.gelu(mm("btd,df->btf", x, p["w1"])), p["w2"])


def experts_ffn(w1: jax.Array, w2: jax.Array, tokens: jax.Array, expert: jax.Array, groups: int) -> jax.Array:
    """Each row of ``tokens`` through its expert's two matrices (``expert`` == ``groups``: a
    padding row, sorted last and left out of every group): sorted by expert, two ragged_dots,
    unsorted."""
    order = jnp.argsort(expert, stable=True)
    sizes = jnp.bincount(expert, length=groups + 1)[:groups].astype(jnp.int32)
    h = grouped_mm(tokens[order], w1, sizes)
    y = grouped_mm(jax.nn.gelu(h), w2, sizes)
    return jnp.zeros_like(y).at[order].set(y)


def route(p: Params, tokens: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """Top-k routing of (n, d) tokens: gates and experts, each (n, k)."""
    return lax.top_k(jax.nn.softmax(mm("nd,de->ne", tokens, p["router"])), cfg.top_k)


def moe(p: Params, x: jax.Array, cfg: Config, mesh: Mesh | None = None) -> jax.Array:
    """Top-k routing, each token copy through its expert, combined with the gate weights. ``x``
    (f32) is cast to bf16 by each of its two readers, the router and the experts, so their
    cotangents sum in f32. On a mesh the experts are split over every device
    (``moe_expert_parallel``)."""
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)
    gates, experts = route(p, tokens, cfg)
    tokens = tokens.astype(COMPUTE)
    if mesh is not None and mesh.size > 1:
        y = moe_expert_parallel(p, tokens, gates, experts, cfg, mesh)
    else:
        y = experts_ffn(p["w1"], p["w2"], jnp.repeat(tokens, cfg.top_k, axis=0), experts.reshape(-1), cfg.experts)
        y = jnp.sum(y.reshape(b * t, cfg.top_k, d) * gates[..., None], axis=1)
    return y.reshape(b, t, d)


def moe_expert_parallel(p: Params, tokens: jax.Array, gates: jax.Array, experts: jax.Array, cfg: Config,
                        mesh: Mesh) -> jax.Array:
    """The MoE layer's experts under ``shard_map`` (routing is a data-parallel product before it,
    whose weight gradient the partitioner sums in f32): each device holds ``experts / devices``
    experts and ``tokens / devices`` tokens. Every token copy is sent to its expert's device
    (all-to-all, room for all of them: no token is dropped), run there through the local
    experts, and sent back (all-to-all) to be combined where it came from."""
    axes, n = tuple(mesh.axis_names), mesh.size
    local_experts = cfg.experts // n

    def shard(w1, w2, x, gates, experts):
        t, d = x.shape
        dest = (experts // local_experts).reshape(-1)  # (t*k,) each copy's device
        copies = t * cfg.top_k
        # each copy's slot in the buffer for its device: its rank among the copies sent there
        rank = jnp.cumsum(jax.nn.one_hot(dest, n, dtype=jnp.int32), axis=0)[jnp.arange(copies), dest] - 1
        send = jnp.zeros((n, copies, d), x.dtype).at[dest, rank].set(jnp.repeat(x, cfg.top_k, axis=0))
        send_expert = jnp.full((n, copies), local_experts, jnp.int32).at[dest, rank].set(
            (experts % local_experts).reshape(-1))
        recv = lax.all_to_all(send, axes, 0, 0, tiled=True).reshape(n * copies, d)
        recv_expert = lax.all_to_all(send_expert, axes, 0, 0, tiled=True).reshape(-1)
        y = experts_ffn(w1, w2, recv, recv_expert, local_experts)
        back = lax.all_to_all(y.reshape(n, copies, d), axes, 0, 0, tiled=True)
        y = back[dest, rank].reshape(t, cfg.top_k, d)
        return jnp.sum(y * gates[..., None], axis=1)

    return jax.shard_map(shard, mesh=mesh, in_specs=(P(axes),) * 5,
                         out_specs=P(axes))(p["w1"], p["w2"], tokens, gates, experts)


def logits(params: Params, h: jax.Array, cfg: Config) -> jax.Array:
    """The tied LM head: hidden states against the token embeddings."""
    return mm("btd,vd->btv", h, params["embed"])


# nothing else saved: without fp8 (no value of that name) as jax.checkpoint's default
KEEP_FP8_WEIGHTS = jax.checkpoint_policies.save_only_these_names(jax_cute.fp8.WEIGHTS)


def forward(params: Params, tokens: jax.Array, cfg: Config, mesh: Mesh | None = None) -> jax.Array:
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]  # f32 residual stream
    ffn = moe if cfg.moe else mlp

    def layer(x, p):
        def block(x):
            x = x + attention(p, norm(x, p["ln1"]), cfg)
            return x + ffn(p, norm(x, p["ln2"]), cfg, mesh)
        # recompute the block in the backward pass; an fp8 run keeps the weights it quantized here
        return jax.checkpoint(block, policy=KEEP_FP8_WEIGHTS)(x), None

    x, _ = lax.scan(layer, x, params["layers"])
    return logits(params, norm(x, params["ln_f"]), cfg)


def loss_fn(params: Params, tokens: jax.Array, cfg: Config, mesh: Mesh | None = None) -> jax.Array:
    out = forward(params, tokens[:, :-1], cfg, mesh)
    return optax.softmax_cross_entropy_with_integer_labels(out, tokens[:, 1:]).mean()


# -- sharding -----------------------------------------------------------------------------------

def parse_mesh(text: str) -> dict[str, int]:
    """``data=N[,model=M]`` as {axis: size}."""
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.strip().partition("=")
        if name not in ("data", "model") or name in axes or not size.isdigit() or int(size) < 1:
            raise ValueError(f"--mesh takes data=N[,model=M] with positive sizes, got {text!r}")
        axes[name] = int(size)
    return axes


def make_mesh(axes: dict[str, int]) -> Mesh:
    """A mesh of the first prod(sizes) devices (of every process), Auto axes: jit's partitioner
    and jax_cute's partitioning rules place each product."""
    n, devices = math.prod(axes.values()), jax.devices()
    if n > len(devices):
        raise SystemExit(f"--mesh {axes} needs {n} devices; {len(devices)} are visible")
    grid = np.array(devices[:n]).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes), axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def _fsdp(spec: P, shape: tuple[int, ...], n: int, first: int) -> P:
    """``spec`` with the first free axis from ``first`` on that ``n`` divides sharded over data."""
    parts = list(spec) + [None] * (len(shape) - len(spec))
    if any("data" in (a if isinstance(a, tuple) else (a,)) for a in parts if a):
        return spec
    for i in range(first, len(shape)):
        if parts[i] is None and shape[i] % n == 0:
            parts[i] = "data"
            return P(*parts)
    return spec


def param_specs(params: Params, cfg: Config, mesh: Mesh, fsdp: bool = False) -> Params:
    """Where each parameter lives: attention heads and MLP width split over ``model`` (column-
    then row-parallel), experts over every device; with ``fsdp`` every weight also split over
    ``data`` along one axis (the partitioner gathers it where a layer uses it)."""
    tp = "model" if "model" in mesh.axis_names else None
    layer = {"ln1": P(), "ln2": P(), "wqkv": P(None, None, None, tp), "wo": P(None, tp)}
    if cfg.moe:
        layer |= {"router": P(), "w1": P(None, tuple(mesh.axis_names)), "w2": P(None, tuple(mesh.axis_names))}
    else:
        layer |= {"w1": P(None, None, tp), "w2": P(None, tp)}
    specs = {"embed": P(), "pos": P(), "ln_f": P(), "layers": layer}
    if fsdp and "data" in mesh.axis_names:
        n = mesh.shape["data"]
        specs = {k: _fsdp(v, params[k].shape, n, 0) for k, v in specs.items() if k != "layers"} | {
            "layers": {k: _fsdp(v, params["layers"][k].shape, n, 1) for k, v in layer.items()}}
    return specs


def check_mesh(cfg: Config, mesh: Mesh) -> None:
    """Clear errors for sizes the mesh does not divide."""
    data, model = mesh.shape.get("data", 1), mesh.shape.get("model", 1)
    if cfg.batch % data:
        raise SystemExit(f"batch {cfg.batch} is not divisible by the data axis ({data})")
    if cfg.heads % model or cfg.d_ff % model:
        raise SystemExit(f"{cfg.heads} heads and MLP width {cfg.d_ff} must be divisible by the model axis ({model})")
    if cfg.moe and (cfg.experts % mesh.size or (cfg.batch * cfg.seq) % mesh.size):
        raise SystemExit(f"{cfg.experts} experts and {cfg.batch * cfg.seq} tokens must be divisible by "
                         f"the {mesh.size} devices")


def place(tree, shardings):
    """Global arrays of ``tree`` (the same host values in every process) laid out by ``shardings``."""
    def one(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    return jax.tree.map(one, tree, shardings)


def scalar(x: jax.Array) -> float:
    """A replicated scalar's value, read from this process's copy."""
    return float(np.asarray(x.addressable_data(0)))


# -- training -----------------------------------------------------------------------------------

def init_train_state(key: jax.Array, cfg: Config):
    tx = optax.adamw(cfg.lr, b1=0.9, b2=0.95, weight_decay=0.1)
    params = init_params(key, cfg)
    return params, tx.init(params), tx


def shard_train_state(params: Params, opt_state, tx, cfg: Config, mesh: Mesh, fsdp: bool = False):
    """The train state on ``mesh`` and the step's (params, opt_state, batch) shardings."""
    specs = param_specs(params, cfg, mesh, fsdp)
    p_sh = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))
    params = place(params, p_sh)
    # AdamW's moments take their parameters' shardings, the step count is replicated (the
    # compiler would replicate every leaf of tx.init's zeros: each device would then hold all
    # of them, and each step would gather its shards of the new moments from every device)
    o_sh = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params), p_sh,
                                 transform_non_params=lambda _: NamedSharding(mesh, P()))
    opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
    batch = NamedSharding(mesh, P("data") if "data" in mesh.axis_names else P())
    return params, opt_state, (p_sh, o_sh, batch)


def fp8_recipe(cfg: Config) -> jax_cute.fp8.Blockwise:
    """Block-scaled fp8 for the weight products, except the tied LM head and the router (by their
    weight's shape and their result's width), which DeepSeek-V3 keeps in 16 bit."""
    kept = {((cfg.vocab, cfg.d_model), cfg.vocab), ((cfg.d_model, cfg.experts), cfg.experts)}
    return jax_cute.fp8.Blockwise(exclude=lambda lhs, rhs, out: (tuple(rhs.shape), out.shape[-1]) in kept)


def make_step(cfg: Config, tx: optax.GradientTransformation, kernelized: bool, fuse_epilogues: bool = True,
              mesh: Mesh | None = None, shardings: tuple | None = None, fp8: bool = False) -> Callable:
    loss = lambda params, tokens: loss_fn(params, tokens, cfg, mesh)  # noqa: E731
    if kernelized:
        loss = jax_cute.kernelize(loss, fuse_epilogues=fuse_epilogues, fp8=fp8_recipe(cfg) if fp8 else None)

    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    if shardings is None:
        return jax.jit(step)
    p_sh, o_sh, batch = shardings
    return jax.jit(step, in_shardings=shardings, out_shardings=(p_sh, o_sh, NamedSharding(batch.mesh, P())))


def batches(key: jax.Array, cfg: Config, n: int = 4, noise: float = 0.0) -> jax.Array:
    """``n`` fixed batches of a learnable language: each sequence counts up from a random start
    by a random stride (of 8) modulo the vocabulary. With ``noise``, that fraction of the tokens
    after the first is replaced by uniformly random ones, which no model predicts: the loss then
    has a floor, and two runs' curves can be compared relative to it over many steps (with few
    batches and no noise the model memorizes them and the loss falls towards zero)."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    start = jax.random.randint(k1, (n, cfg.batch, 1), 0, cfg.vocab)
    stride = jax.random.randint(k2, (n, cfg.batch, 1), 1, 9)
    tokens = (start + stride * jnp.arange(cfg.seq + 1)) % cfg.vocab
    noisy = (jax.random.uniform(k3, tokens.shape) < noise) & (jnp.arange(cfg.seq + 1) > 0)
    return jnp.where(noisy, jax.random.randint(k4, tokens.shape, 0, cfg.vocab), tokens).astype(jnp.int32)


def train(step: Callable, params, opt_state, data: list, steps: int, label: str,
          verbose: bool) -> tuple[list[float], list[float]]:
    losses, times = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, data[i % len(data)])
        losses.append(scalar(loss))  # blocks until the step is done
        times.append((time.perf_counter() - t0) * 1e3)
        if verbose:
            print(f"[{label}] step {i:3d}  loss {losses[-1]:.5f}  {times[-1]:8.2f} ms")
    return losses, times


def init_distributed(arg: str) -> None:
    """``jax.distributed`` from ``COORDINATOR,PROCESSES,PROCESS_ID`` (or from the environment of a
    cluster JAX knows, when ``auto``)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes too (GPUs use NCCL)
    if arg == "auto":
        jax.distributed.initialize()
        return
    try:
        coordinator, processes, pid = arg.split(",")
        processes, pid = int(processes), int(pid)
    except ValueError:
        raise SystemExit(f"--distributed takes auto or HOST:PORT,PROCESSES,PROCESS_ID, got {arg!r}") from None
    jax.distributed.initialize(coordinator, processes, pid)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float)
    p.add_argument("--batch", type=int, help="global batch (sequences per step); default: the size's")
    p.add_argument("--batches", type=int, default=4, help="distinct batches, cycled through (default 4)")
    p.add_argument("--noise", type=float, default=0.0,
                   help="fraction of tokens replaced by random ones (a loss floor for long comparisons)")
    p.add_argument("--moe", action="store_true", help="top-2 of 8 experts instead of the dense MLP")
    p.add_argument("--fp8", action="store_true", help="kernelized run: block-scaled fp8 weight products")
    p.add_argument("--mesh", help="train on a device mesh: data=N[,model=M] (N x M devices)")
    p.add_argument("--fsdp", action="store_true", help="with --mesh: also shard every weight over data")
    p.add_argument("--distributed", metavar="auto|HOST:PORT,PROCESSES,PROCESS_ID",
                   help="one process per GPU (or per host) through jax.distributed")
    p.add_argument("--no-compare", action="store_true", help="skip the plain XLA run")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    if args.distributed:
        init_distributed(args.distributed)
    on_gpu = jax.default_backend() == "gpu"
    overrides = {k: v for k, v in (("lr", args.lr), ("batch", args.batch)) if v}
    cfg = dataclasses.replace(SIZES[args.size or ("h200" if on_gpu else "tiny")], moe=args.moe, **overrides)
    mesh = make_mesh(parse_mesh(args.mesh)) if args.mesh else None
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)

    params, opt_state, tx = init_train_state(jax.random.key(0), cfg)
    if args.batches < 1 or not 0.0 <= args.noise < 1.0:
        raise SystemExit(f"--batches takes a positive count and --noise a fraction in [0, 1): "
                         f"got {args.batches} and {args.noise}")
    data = list(batches(jax.random.key(1), cfg, args.batches, args.noise))
    shardings = None
    if mesh is not None:
        check_mesh(cfg, mesh)
        params, opt_state, shardings = shard_train_state(params, opt_state, tx, cfg, mesh, args.fsdp)
        data = [place(d, shardings[2]) for d in data]
    ffn = f"MoE FFN (top-{cfg.top_k} of {cfg.experts} experts, width {cfg.d_ff})" if cfg.moe else f"MLP width {cfg.d_ff}"
    say(f"GPT: d_model {cfg.d_model}, {cfg.heads} heads, {cfg.layers} layers, {ffn}, vocab {cfg.vocab}, "
        f"batch {cfg.batch} x {cfg.seq} tokens; bf16 products"
        f"{' (kernelized run: fp8 weight products)' if args.fp8 else ''}, "
        f"f32 master weights, AdamW (lr {cfg.lr}), "
        f"{args.steps} steps")
    devices = mesh.size if mesh is not None else 1
    if mesh is not None:
        say(f"mesh {dict(mesh.shape)}{' with fully sharded weights' if args.fsdp else ''} over {devices} devices"
            f"{f' in {jax.process_count()} processes' if jax.process_count() > 1 else ''}")
    kstep = make_step(cfg, tx, kernelized=True, mesh=mesh, shardings=shardings, fp8=args.fp8)
    path = path_taken(kstep, params, opt_state, data[0])
    say(f"path: {path}")
    losses, times = train(kstep, params, opt_state, data, args.steps, "kernelized", lead and not args.quiet)
    ms = statistics.median(times[1:] or times)
    tokens_per_s = cfg.batch * cfg.seq / ms * 1e3
    out = {"path": path, "devices": devices, "processes": jax.process_count(),
           "mesh": dict(mesh.shape) if mesh is not None else {}, "fsdp": args.fsdp, "moe": cfg.moe, "fp8": args.fp8,
           "batch": cfg.batch, "seq": cfg.seq, "losses": losses, "ms": ms,
           "tokens_per_s_per_device": tokens_per_s / devices}
    if not args.no_compare:
        pstep = make_step(cfg, tx, kernelized=False, mesh=mesh, shardings=shardings)
        ref_losses, ref_times = train(pstep, params, opt_state, data, args.steps, "plain XLA", lead and not args.quiet)
        ref_ms = statistics.median(ref_times[1:] or ref_times)
        say(f"{'step':>4}  {'kernelized':>10}  {'plain XLA':>10}")
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            say(f"{i:4d}  {a:10.5f}  {b:10.5f}")
        rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
        say(f"max relative difference between the loss curves: {rel:.2e}")
        comparison = compare_line(("kernelized", "plain XLA"), ms, ref_ms)
        say(comparison)
        out |= {"ref_losses": ref_losses, "max_rel_diff": rel, "ref_ms": ref_ms, "comparison": comparison,
                "ref_tokens_per_s_per_device": cfg.batch * cfg.seq / ref_ms * 1e3 / devices}
    say(f"kernelized: {ms:.2f} ms/step, {out['tokens_per_s_per_device']:.0f} tokens/s per device")
    if args.json and lead:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if not losses[-1] < losses[0]:
        raise SystemExit(f"loss did not go down: {losses[0]} -> {losses[-1]}")
    return out


if __name__ == "__main__":
    main()

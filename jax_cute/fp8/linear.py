"""fp8 training products: a linear layer and a grouped (MoE) one whose three GEMMs are block-scaled.

DeepSeek-V3's recipe (arXiv 2412.19437, section 3.3): the forward product ``y = x @ w`` and both
gradient products run in fp8 with float32 promotion per 128-K block:

- forward: x in 1 x 128 blocks along K, w in 128 x 128 blocks;
- dgrad ``dx = dy @ w.T``: dy in 1 x 128 blocks along N, w's 128 x 128 blocks read transposed
  (a square block transposes into itself; only the values move, so K is contiguous for WGMMA);
- wgrad ``dw = x.T @ dy``: both quantized in 1 x 128 blocks along the tokens (the contracting
  axis of this product); the forward pass stores x so quantized (fp8: half of bf16's memory) as
  its residual. For the grouped layer the token blocks restart at each group
  (``quantize_grouped``), and ``dw`` is the ragged-K product.

The master weights stay as they are (f32 or bf16): ``w`` is quantized on the fly, and its
gradient is returned in ``w``'s dtype, ``dx`` in ``x``'s.

An epilogue ``act(x @ w + bias)``: the bias is added in the kernel, which writes the
pre-activation ``z`` (kept as a residual); the activation runs in XLA in float32, where it fuses
into whatever reads ``y`` (e.g. the next layer's quantization). The backward pass forms
``dz = dy * act'(z)`` once, in ``dy``'s dtype, and runs both gradient GEMMs on it. A gated
activation (swiglu: ``y = silu(z[:, :N/2]) * z[:, N/2:]``) takes the gate and up columns side by
side in one weight (K, N) and gives N/2 columns; ``dz`` is its vector-Jacobian product.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_cute.activations import apply_activation, check_activation, derivative_times, is_gated
from jax_cute.fp8.ops import ragged_k_dot, ragged_k_dot_aligned, scaled_dot_general, scaled_ragged_dot
from jax_cute.fp8.quantize import (BLOCK, E4M3, FP8_DTYPES, BlockScaled, checkpoint_named, clipped_sizes, group_blocks,
                                   group_ends, quantize, quantize_grouped, row_groups)
from jax_cute.fp8.scaled import weight_kernel, wgrad_kernels
from jax_cute.primitives.sharding import auto_axes, explicit_axes

# The name (``jax.ad_checkpoint.checkpoint_name``) of the layers' quantized weights: under
# ``jax.checkpoint(..., policy=jax.checkpoint_policies.save_only_these_names(WEIGHTS))`` the
# backward pass's recomputation reads the forward pass's fp8 weights (1 byte a value in each of
# their two layouts) instead of quantizing the weights again.
WEIGHTS = "jax_cute.fp8.weights"


@dataclasses.dataclass(frozen=True)
class Blockwise:
    """The block-scaled fp8 recipe (DeepSeek-V3 / DeepGEMM): e4m3 values, 1 x 128 activation and
    128 x 128 weight scales, float32 promotion per 128-K block.

    ``dtype``: the fp8 type of activations and weights; ``grad_dtype``: that of the output
    gradients (DeepSeek uses e4m3 for both, the fine-grained scales taking the place of e5m2's
    range). ``pow2_scales``: scales rounded up to powers of two (DeepGEMM's ue8m0).
    ``exclude(lhs_aval, rhs_aval, out_aval)``: for ``kernelize``, products (by their operand and
    result types) to keep in 16 bit, e.g. an LM head or a router.
    """

    dtype: np.dtype = E4M3
    grad_dtype: np.dtype = E4M3
    pow2_scales: bool = False
    exclude: object = None  # Callable[[ShapedArray, ShapedArray, ShapedArray], bool] | None

    def __post_init__(self):
        for name in ("dtype", "grad_dtype"):
            dt = np.dtype(getattr(self, name))
            if dt not in FP8_DTYPES:
                raise TypeError(f"jax_cute.fp8.Blockwise: {name} must be float8_e4m3fn or float8_e5m2, got {dt}")
            object.__setattr__(self, name, dt)
        if self.exclude is not None and not callable(self.exclude):
            raise TypeError(f"jax_cute.fp8.Blockwise: exclude must be callable, got {self.exclude!r}")

    def q(self, x, block, grad: bool = False):
        return quantize(x, block, pow2_scales=self.pow2_scales, dtype=self.grad_dtype if grad else self.dtype)

    def q_weight(self, w) -> tuple[BlockScaled, BlockScaled]:
        """``q(w, "128x128")`` for w (K, N) or (G, K, N), twice: for dgrad, and for the forward
        product with its values stored transposed, K-major as that kernel reads them. By one
        kernel that reads w once (``weight_operands.quantize_weight``) where it takes w (amax /
        fmax scales, K and N multiples of 128); else one quantization serves both. Named
        ``WEIGHTS`` for checkpoint policies."""
        kernel = None if self.pow2_scales else weight_kernel(w.shape, w.dtype)
        if kernel is None:
            wq = checkpoint_named(self.q(w, "128x128"), WEIGHTS)
            return wq, wq
        return kernel.quantize_weight(w, self.dtype, name=WEIGHTS)

    def q_weight_stack(self, w) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        """Weights w (..., K, N), each quantized as ``q_weight`` quantizes it, by one launch of
        the weight kernel (``kernelize`` quantizes a scanned stack of layer weights so, once,
        before the scan): the kernel's outputs, values (..., K, N), the same values transposed
        (..., N, K) and scales (..., K / 128, N / 128), whose slices ``quantize.weight_pair``
        turns into one weight's operands; None where the kernel does not take w."""
        lead, (k, n) = w.shape[:-2], w.shape[-2:]
        flat = (math.prod(lead), k, n)
        kernel = None if self.pow2_scales else weight_kernel(flat, w.dtype)
        if kernel is None:
            return None
        values, values_t, scales = kernel.stored(w.reshape(flat), self.dtype)
        return values.reshape(w.shape), values_t.reshape(*lead, n, k), scales.reshape(*lead, k // BLOCK, n // BLOCK)

    def q_tokens(self, x, grad: bool = False, kernel: bool = False) -> BlockScaled:
        """``x`` (M, K) as ``q(x.T, "1x128")``: (K, M) in blocks of 128 tokens, for a weight
        gradient. With ``kernel`` (where ``wgrad_kernel`` says so) by
        ``wgrad_operands.quantize_tokens``: one pass over x, the fp8 values written transposed,
        M zero-padded to whole blocks (the product is the same). Else quantized in x's own
        layout and the values transposed after (reducing along the rows of a transposed operand
        is several times slower in XLA)."""
        dt = self.grad_dtype if grad else self.dtype
        if not kernel:
            return quantize(x, (BLOCK, 1), pow2_scales=self.pow2_scales, dtype=dt).T
        kernels = _wgrad_kernels(x.shape[1], self.pow2_scales)
        values, scales = kernels.quantize_tokens(x, *kernels.uniform_blocks(x.shape[0]), dt)
        return BlockScaled(values, scales, (BLOCK,))

    def q_rows_and_tokens(self, x, grad: bool = False, kernel: bool = False) -> tuple[BlockScaled, BlockScaled]:
        """(``q(x, "1x128")``, ``q_tokens(x)``): ``x`` (M, K) for the product that contracts K and
        for the weight gradient, which contracts the tokens. With ``kernel`` (as ``q_tokens``) and
        where it takes x (16-bit, K a multiple of 128), both by one kernel that reads x once
        (``wgrad_operands.quantize_rows_and_tokens``)."""
        dt = self.grad_dtype if grad else self.dtype
        kernels = _wgrad_kernels(x.shape[1], self.pow2_scales) if kernel else None
        if kernels is None or not kernels.rows_and_tokens_supported(x.shape, x.dtype):
            return self.q(x, "1x128", grad), self.q_tokens(x, grad, kernel)
        rows, (values, scales) = kernels.quantize_rows_and_tokens(x, dt)
        return rows, BlockScaled(values, scales, (BLOCK,))

    def q_grouped(self, x, sizes, grad: bool = False, aligned: bool = False):
        """``x`` (M, K) for a grouped weight gradient: ``quantize_grouped(x.T, sizes)``; with
        ``aligned`` (where ``wgrad_kernel`` says so) by ``wgrad_operands.quantize_tokens``, as
        (values, scales) already in the ragged-K kernel's group-aligned layout."""
        dt = self.grad_dtype if grad else self.dtype
        if not aligned:
            return quantize_grouped(x.T, sizes, pow2_scales=self.pow2_scales, dtype=dt)
        _, bstart, blen, _ = group_blocks(sizes, x.shape[0])
        return _wgrad_kernels(x.shape[1], self.pow2_scales).quantize_tokens(x, bstart, blen, dt)

    def q_rows_and_grouped(self, x, sizes, grad: bool = False, aligned: bool = False):
        """(``q(x, "1x128")``, ``q_grouped(x, sizes, aligned=aligned)``): x (M, K) for the grouped
        product that contracts K and for the weight gradient. With ``aligned`` and where it takes
        x, both by one kernel that reads x once (``wgrad_operands.quantize_rows_and_group_tokens``),
        which quantizes the rows past the last group, which no grouped product reads, as zeros."""
        dt = self.grad_dtype if grad else self.dtype
        kernels = _wgrad_kernels(x.shape[1], self.pow2_scales) if aligned else None
        if kernels is None or not kernels.rows_and_tokens_supported(x.shape, x.dtype):
            return self.q(x, "1x128", grad), self.q_grouped(x, sizes, grad, aligned)
        return kernels.quantize_rows_and_group_tokens(x, sizes, dt)

    def wgrad_kernel(self, tokens: int, *rows: int) -> bool:
        """Whether a weight gradient over ``tokens`` whose two operands have these column counts
        quantizes both by the kernel (``q_tokens``/``q_grouped`` with ``kernel``/``aligned``).
        Decided from static shapes, so the forward and backward passes decide alike."""
        return tokens > 0 and all(_wgrad_kernels(r, self.pow2_scales) is not None for r in rows)


def _wgrad_kernels(rows: int, pow2_scales: bool):
    """``scaled.wgrad_kernels`` where its quantizer takes an operand of ``rows`` columns with
    these scales, else None (XLA's quantization)."""
    return None if pow2_scales else wgrad_kernels(rows)   # (it computes amax / fmax scales only)


def _check_float(op: str, **xs) -> None:
    for name, x in xs.items():
        if not jnp.issubdtype(x.dtype, jnp.floating) or np.dtype(x.dtype) in FP8_DTYPES:
            raise TypeError(f"jax_cute.fp8.{op}: {name} must be a 16- or 32-bit float array (it is quantized "
                            f"here), got {x.dtype}")


def _grad_out(dtype: str) -> str:
    """A gradient GEMM's output dtype: its input's, rounded once from the float32 accumulator in
    the kernel (as casting a float32 result would, without writing and reading that result);
    float32 for wider inputs (cast after)."""
    return dtype if dtype in ("bfloat16", "float16", "float32") else "float32"


def _check_epilogue(op: str, bias, activation, n_shape: tuple[int, ...]) -> None:
    """``n_shape``: w's output axes (a gated activation pairs the halves of one even axis)."""
    check_activation(f"fp8.{op}", activation)
    if is_gated(activation) and (len(n_shape) != 1 or n_shape[0] % 2):
        raise ValueError(f"jax_cute.fp8.{op}: the gated {activation!r} pairs the two halves of one output axis "
                         f"(gate, then up): w's output axes must be one even N, got {n_shape}")
    if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"jax_cute.fp8.{op}: bias must be floating point, got {bias.dtype}")


def linear(x: jax.Array, w: jax.Array, *, bias=None, activation: str | None = None, out_dtype=None,
           recipe: Blockwise = Blockwise(), w_quantized: tuple[BlockScaled, BlockScaled] | None = None) -> jax.Array:
    """``act(x @ w + bias)`` for x (..., K) and w (K, ...), its forward and both gradient GEMMs
    block-scaled fp8 (the module docstring). The result is (..., *w.shape[1:]) in ``out_dtype``
    (default: x's dtype; bfloat16, float16 or float32). ``bias`` broadcasts to ``w.shape[1:]``
    (one value per output column); ``activation``: an activation of ``jax_cute.activations``, or
    None; a gated one (swiglu) takes w (K, N) with the gate columns, then the up columns, and
    gives (..., N/2). Differentiable in x, w and bias (``custom_vjp``).

    ``w_quantized``: w's two operands as ``recipe.q_weight`` gives them for w as (K, N), where the
    caller quantized w already (``kernelize`` quantizes a scanned stack of layer weights once,
    before the scan); then w is not read, only its gradient is formed, and these get none."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    _check_float("linear", x=x, w=w)
    if x.ndim < 1 or w.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"jax_cute.fp8.linear: x (..., K) and w (K, ...) must share K, got {x.shape} and {w.shape}")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.ndim > w.ndim - 1 or any(b not in (1, n) for b, n in zip(bias.shape[::-1], w.shape[:0:-1])):
            raise ValueError(f"jax_cute.fp8.linear: bias must broadcast to w.shape[1:] = {w.shape[1:]}, "
                             f"got {bias.shape}")
    _check_epilogue("linear", bias, activation, w.shape[1:])
    out = np.dtype(x.dtype if out_dtype is None else out_dtype)
    k = x.shape[-1]
    if bias is not None:
        # one entry per column of the (M, N) product, in float32 (the kernel adds it in float32):
        # autodiff then sums a broadcast bias's gradient in float32 before rounding it to its dtype
        bias = jnp.broadcast_to(bias.astype(jnp.float32), w.shape[1:]).reshape(-1)
    w2 = w.reshape(k, -1)
    _check_quantized("linear", w_quantized, w2.shape, recipe)
    x2 = x.reshape(-1, k)
    y = _linear(x2, w2, bias, w_quantized, _dtypes(out, x2, w2, bias), recipe, activation)
    return y.reshape(*x.shape[:-1], *(w.shape[1] // 2,) if is_gated(activation) else w.shape[1:])


def _check_quantized(op: str, wq, shape: tuple[int, ...], recipe: Blockwise) -> None:
    """``w_quantized`` must be two BlockScaled operands of ``shape`` in the recipe's fp8 type."""
    if wq is None:
        return
    if not (isinstance(wq, tuple) and len(wq) == 2 and all(isinstance(q, BlockScaled) for q in wq)):
        raise TypeError(f"jax_cute.fp8.{op}: w_quantized must be the pair Blockwise.q_weight returns, got {wq!r}")
    for q in wq:
        if q.shape != tuple(shape) or q.dtype != recipe.dtype or q.blocks[-2:] != (BLOCK, BLOCK):
            raise ValueError(f"jax_cute.fp8.{op}: w_quantized must be {recipe.dtype} {shape} in {BLOCK} x {BLOCK} "
                             f"blocks, got {q.dtype} {q.shape} in blocks {q.blocks}")


def _weight(recipe: Blockwise, w, wq):
    """w's two operands (dgrad's, the forward product's): given, or quantized here."""
    return recipe.q_weight(w) if wq is None else wq


def _dtypes(out, x, w, bias) -> tuple:
    """(out, x, w, bias or None) dtype names, then x's, w's and bias' (sharding on Explicit mesh
    axes or None, manual mesh axes it varies over inside shard_map): the custom_vjp's statics,
    so that each gradient takes its primal's type."""
    types = tuple(None if a is None else (_explicit_sharding(a), jax.typeof(a).mat.varying) for a in (x, w, bias))
    return (out.name, np.dtype(x.dtype).name, np.dtype(w.dtype).name,
            None if bias is None else np.dtype(bias.dtype).name, types)


def _explicit_sharding(x):
    sharding = jax.typeof(x).sharding
    return sharding if explicit_axes(sharding.mesh) else None


def _sharded_tokens(x) -> bool:
    """Whether x's tokens (its first axis) may be sharded: its type shards them (Explicit mesh
    axes), or a mesh with Auto axes over several devices is in context (``jax.set_mesh``) or
    in x's type (x computed from arrays placed on such a mesh: jit traces them with it), where
    only the partitioner knows."""
    sharding = _explicit_sharding(x)
    if sharding is not None:
        return bool(sharding.spec) and sharding.spec[0] is not None
    return any(auto_axes(m) for m in (jax.sharding.get_abstract_mesh(), jax.typeof(x).sharding.mesh))


def _typed(grads: tuple, types: tuple) -> tuple:
    """Each gradient in its primal's type (``_dtypes``): resharded to it on Explicit mesh axes;
    inside shard_map summed over the manual axes the primal does not vary over (a replicated
    weight's gradient is the sum of its shards', as lax's own transposes give it) and varying
    over those it does."""
    out = []
    for g, t in zip(grads, types):
        if g is not None and t is not None:
            sharding, varying = t
            have = jax.typeof(g).mat.varying
            if have - varying:
                g = jax.lax.psum(g, tuple(sorted(have - varying)))
            if varying - have:
                g = jax.lax.pcast(g, tuple(sorted(varying - have)), to="varying")
            g = g if sharding is None else jax.sharding.reshard(g, sharding)
        out.append(g)
    return tuple(out)


def _activate(activation, z, out_dtype):
    """``act(z)`` in float32, rounded once to ``out_dtype``."""
    return apply_activation(activation, z.astype(jnp.float32)).astype(out_dtype)


def _dz(activation, z, g):
    """The pre-activation's cotangent ``g * act'(z)`` (float32, rounded to g's dtype; a gated
    activation's vector-Jacobian product, twice g's width): formed once for both gradient GEMMs
    and the bias."""
    if activation is None:
        return g
    if is_gated(activation):
        _, vjp = jax.vjp(lambda z: apply_activation(activation, z), z.astype(jnp.float32))
        return vjp(g.astype(jnp.float32))[0].astype(g.dtype)
    return derivative_times(activation, z, g, jnp.float32).astype(g.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _linear(x, w, bias, wq, dtypes: tuple[str, str, str], recipe: Blockwise, activation: str | None):
    z = _product(recipe.q(x, "1x128"), _weight(recipe, w, wq)[1], bias, dtypes[0])   # (no residuals to quantize)
    return z if activation is None else _activate(activation, z, dtypes[0])


def _product(xq, wq, bias, out_dtype):
    return scaled_dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype, bias=bias)


def _linear_fwd(x, w, bias, given, dtypes, recipe, activation):
    out_dtype = dtypes[0]
    wq, wq_fwd = _weight(recipe, w, given)
    # wgrad contracts the tokens: x quantized along them too, stored K-major (x.T) as the kernel
    # reads it (both from one read of x where the kernel takes it)
    xq, xq_t = recipe.q_rows_and_tokens(x, kernel=recipe.wgrad_kernel(*x.shape, w.shape[1]))
    z = _product(xq, wq_fwd, bias, out_dtype)
    # the pre-activation z (out_dtype) only where act' needs it
    res = (xq_t, wq, None if activation is None else z)
    return (z if activation is None else _activate(activation, z, out_dtype)), res


def _linear_bwd(dtypes, recipe, activation, res, g):
    (_, x_dtype, w_dtype, bias_dtype, types), (xq_t, wq, z) = dtypes, res
    g = _dz(activation, z, g)
    kernel = recipe.wgrad_kernel(g.shape[0], xq_t.shape[0], g.shape[1])   # as the forward pass decided
    # (M, N) in blocks along N, dgrad's K; (N, M) in blocks along the tokens, wgrad's K
    gq, gq_t = recipe.q_rows_and_tokens(g, grad=True, kernel=kernel)
    # each gradient leaves its kernel in its input's dtype: the accumulator rounded once, as an f32
    # result cast afterwards would be, without writing and reading the f32 result
    dx = scaled_dot_general(gq, wq, (((1,), (1,)), ((), ())), preferred_element_type=_grad_out(x_dtype))
    dw = scaled_dot_general(xq_t, gq_t, (((1,), (1,)), ((), ())), preferred_element_type=_grad_out(w_dtype))
    db = None if bias_dtype is None else jnp.sum(g.astype(jnp.float32), axis=0).astype(bias_dtype)
    return (*_typed((dx.astype(x_dtype), dw.astype(w_dtype), db), types), None)   # (given operands: no gradient)


_linear.defvjp(_linear_fwd, _linear_bwd)


def grouped_linear(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, bias=None, activation: str | None = None,
                   out_dtype=None, recipe: Blockwise = Blockwise(),
                   w_quantized: tuple[BlockScaled, BlockScaled] | None = None) -> jax.Array:
    """``act(lax.ragged_dot(x, w, group_sizes) + bias[group])`` (x (M, K), w (G, K, N), bias (G, N)
    or None, ``activation`` as :func:`linear`'s: a gated one gives (M, N/2)) with its forward, dgrad and wgrad GEMMs
    block-scaled fp8: forward and dgrad grouped over M, wgrad over K (the tokens, in blocks that
    restart at each group). Rows past the last group are zero (no bias; the activations are zero
    at zero) and get a zero gradient. Differentiable in x, w and bias; ``w_quantized`` as
    :func:`linear`'s, for w (G, K, N)."""
    x, w, group_sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes)
    _check_float("grouped_linear", x=x, w=w)
    if x.ndim != 2 or w.ndim != 3 or group_sizes.shape != (w.shape[0],) or x.shape[1] != w.shape[1]:
        raise ValueError(f"jax_cute.fp8.grouped_linear: expected x (M, K), w (G, K, N), group_sizes (G,); got "
                         f"{x.shape}, {w.shape}, {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"jax_cute.fp8.grouped_linear: group_sizes must be integers, got {group_sizes.dtype}")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (w.shape[0], w.shape[2]):
            raise ValueError(f"jax_cute.fp8.grouped_linear: bias must be (G, N) = {(w.shape[0], w.shape[2])}, "
                             f"got {bias.shape}")
    _check_epilogue("grouped_linear", bias, activation, w.shape[2:])
    out = np.dtype(x.dtype if out_dtype is None else out_dtype)
    _check_quantized("grouped_linear", w_quantized, w.shape, recipe)
    return _grouped(x, w, group_sizes.astype(jnp.int32), bias, w_quantized, _dtypes(out, x, w, bias), recipe,
                    activation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _grouped(x, w, sizes, bias, wq, dtypes: tuple, recipe: Blockwise, activation: str | None):
    z = scaled_ragged_dot(recipe.q(x, "1x128"), _weight(recipe, w, wq)[1], sizes, preferred_element_type=dtypes[0],
                          bias=bias)   # (no residuals to quantize)
    return z if activation is None else _activate(activation, z, dtypes[0])


def _grouped_fwd(x, w, sizes, bias, given, dtypes, recipe, activation):
    out_dtype = dtypes[0]
    wq, wq_fwd = _weight(recipe, w, given)  # (G, K, N): 128 x 128 blocks of each expert
    # the group-aligned layout gathers every token: where they may be sharded, the weight gradient
    # takes quantize_grouped's layout, whose blocks each shard quantizes and contracts where its
    # tokens lie (quantize_sharding, scaled_sharding)
    aligned = recipe.wgrad_kernel(*x.shape, w.shape[2]) and not _sharded_tokens(x)
    xq, xq_t = recipe.q_rows_and_grouped(x, sizes, aligned=aligned)
    z = scaled_ragged_dot(xq, wq_fwd, sizes, preferred_element_type=out_dtype, bias=bias)
    res = (xq_t, wq, sizes, None if activation is None else z)
    return (z if activation is None else _activate(activation, z, out_dtype)), res


def _grouped_bwd(dtypes, recipe, activation, res, g):
    (_, x_dtype, w_dtype, bias_dtype, types), (xq_t, wq, sizes, z) = dtypes, res
    g = _dz(activation, z, g)
    aligned = isinstance(xq_t, tuple)   # as the forward pass decided (values, scales)
    gq, gq_t = recipe.q_rows_and_grouped(g, sizes, grad=True, aligned=aligned)
    dx = scaled_ragged_dot(gq, wq.T, sizes, preferred_element_type=_grad_out(x_dtype))
    if aligned:
        clipped = clipped_sizes(group_ends(sizes, g.shape[0]))
        dw = ragged_k_dot_aligned(xq_t, gq_t, clipped, preferred_element_type=_grad_out(w_dtype))
    else:
        dw = ragged_k_dot(xq_t, gq_t, sizes, preferred_element_type=_grad_out(w_dtype))
    db = None
    if bias_dtype is not None:  # each group's rows summed; rows past the last group (id G) dropped
        groups = sizes.shape[0]
        _, rows = row_groups(sizes, g.shape[0])
        db = jax.ops.segment_sum(g.astype(jnp.float32), rows, num_segments=groups + 1)[:groups].astype(bias_dtype)
    dx, dw, db = _typed((dx.astype(x_dtype), dw.astype(w_dtype), db), types)
    return dx, dw, None, db, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)

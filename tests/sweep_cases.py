"""Randomized GEMM cases: shapes from 1 to 2056 (odd and unaligned included), transposes, 0-3
batch modes, broadcast operands, vmap over any axis, gradients, bf16 and fp16 inputs with 16-bit
or f32 outputs. The CPU test lowers every case for sm_90a and counts fallbacks; the GPU test runs
them against a float32 reference."""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_cute

DTYPES = (jnp.bfloat16, jnp.float16)
EXTENTS = (1, 7, 8, 33, 64, 127, 130, 256, 511, 1000, 2056)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: object
    ours: Callable
    ref: Callable   # the same math in jnp/lax, evaluated in float32


def _extent(rng: random.Random, big: bool) -> int:
    return rng.choice(EXTENTS if big else EXTENTS[:7])


def _matmul_case(rng: random.Random, i: int, dtype) -> Case:
    m, n, k = (_extent(rng, True) for _ in range(3))
    nb = rng.randint(0, 3)
    batch = tuple(rng.choice((1, 2, 3)) for _ in range(nb))
    if m * n * k * max(1, int(np.prod(batch))) > 2**31:  # keep the GPU run short
        m = min(m, 256)
    ta, tb = rng.random() < 0.5, rng.random() < 0.5
    # broadcast: an operand may drop leading batch axes or have extent 1 in some of them
    ba = tuple(b if rng.random() < 0.7 else 1 for b in batch)[rng.randint(0, nb):] if nb else ()
    bb = tuple(b if rng.random() < 0.7 else 1 for b in batch)[rng.randint(0, nb):] if nb else ()
    sa = ba + ((k, m) if ta else (m, k))
    sb = bb + ((n, k) if tb else (k, n))
    pet = rng.choice((None, jnp.float32))

    def ours(a, b):
        return jax_cute.matmul(a, b, transpose_a=ta, transpose_b=tb, preferred_element_type=pet)

    def ref(a, b):
        a = jnp.swapaxes(a, -1, -2) if ta else a
        b = jnp.swapaxes(b, -1, -2) if tb else b
        return jnp.matmul(a, b, precision="highest")

    return Case(f"{i}-matmul-{sa}x{sb}{'-ta' if ta else ''}{'-tb' if tb else ''}-{pet and 'f32'}", (sa, sb), dtype,
                ours, ref)


def _vmap_case(rng: random.Random, i: int, dtype) -> Case:
    m, n, k = (_extent(rng, False) for _ in range(3))
    v = rng.choice((2, 3, 5))
    ia, ib = rng.choice((0, 1, 2, None)), rng.choice((0, 1, 2, None))
    if ia is None and ib is None:
        ia = 0
    sa, sb = [m, k], [k, n]
    if ia is not None:
        sa.insert(ia, v)
    if ib is not None:
        sb.insert(ib, v)
    return Case(f"{i}-vmap{ia},{ib}-{tuple(sa)}x{tuple(sb)}", (tuple(sa), tuple(sb)), dtype,
                jax.vmap(jax_cute.matmul, in_axes=(ia, ib)),
                jax.vmap(lambda a, b: jnp.matmul(a, b, precision="highest"), in_axes=(ia, ib)))


def _grad_case(rng: random.Random, i: int, dtype) -> Case:
    base = _matmul_case(rng, i, dtype)

    def grads(f):
        def g(a, b):
            return jax.grad(lambda x, y: (f(x, y).astype(jnp.float32) * 0.01).sum(), (0, 1))(a, b)
        return g

    return Case(base.name.replace("matmul", "grad"), base.shapes, dtype, grads(base.ours), grads(base.ref))


def _einsum_case(rng: random.Random, i: int, dtype) -> Case:
    b, h = rng.choice((1, 2, 3)), rng.choice((1, 2, 4))
    t, s, d = rng.choice((7, 64, 130)), rng.choice((8, 33, 128)), rng.choice((8, 64, 127))
    spec, sa, sb = rng.choice([("bthd,bshd->bhts", (b, t, h, d), (b, s, h, d)),
                               ("bhts,bshd->bthd", (b, h, t, s), (b, s, h, d)),
                               ("btd,sd->bts", (b, t, d), (s, d))])
    return Case(f"{i}-einsum-{spec}-{sa}x{sb}", (sa, sb), dtype,
                lambda x, y: jax_cute.einsum(spec, x, y),
                lambda x, y: jnp.einsum(spec, x, y, precision="highest"))


def cases(count: int = 60, seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    makers = (_matmul_case, _matmul_case, _vmap_case, _grad_case, _einsum_case)
    return [rng.choice(makers)(rng, i, rng.choice(DTYPES)) for i in range(count)]


def einsum_specs(count: int = 24, seed: int = 1,
                 big: bool = False) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Random two-operand einsums: 0-2 batch, 1-2 free labels per operand and 1-2 contracted, each
    operand's and the output's labels in a random order; one label of each kind is large
    (64-256 with ``big``, else 16-32) so every product is a real GEMM."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        letters = list("abcdefghij")
        rng.shuffle(letters)
        nb, nm, nn, nk = rng.randint(0, 2), rng.randint(1, 2), rng.randint(1, 2), rng.randint(1, 2)
        b, m = letters[:nb], letters[nb:nb + nm]
        n, k = letters[nb + nm:nb + nm + nn], letters[nb + nm + nn:nb + nm + nn + nk]
        ext = {c: rng.choice((2, 3, 4, 8)) for c in b + m + n + k}
        for c in (m[0], n[0], k[0]):
            ext[c] = rng.choice((64, 128, 256) if big else (16, 24, 32))
        sa, sb, sc = b + m + k, b + k + n, b + m + n
        for x in (sa, sb, sc):
            rng.shuffle(x)
        out.append((f"{''.join(sa)},{''.join(sb)}->{''.join(sc)}", tuple(ext[c] for c in sa),
                    tuple(ext[c] for c in sb)))
    return out

"""What a dense or grouped GEMM kernel is asked to compute, independent of the arch.

The logical modes follow CuTe's GEMM convention: A is (M, K, L), B is (N, K, L), C is
(M, N, L), so ``C[m, n, l] = sum_k A[m, k, l] * B[n, k, l]``. Each operand has one unit-stride
("major") mode; every other stride is dynamic and a multiple of 16 bytes, which TMA needs.
The batch count is C's L; an operand whose L extent is 1 is broadcast over every batch. L may
instead be three batch modes (``batch_modes=3``: rank-5 operands (rows, cols, L0, L1, L2), the
batch index split colexicographically, L0 fastest); an operand whose extent in one of them is 1
is broadcast over that mode.
"""

from __future__ import annotations

import dataclasses

from jax_cute.kernels import epilogue as fused_epilogue
from jax_cute.kernels.abi import DYN, Dyn, Signature, StreamArg, TensorArg

# Dtypes some family of some arch takes: a product outside them has no kernel anywhere, which
# is known when it is traced, on any platform.
# one dtype for both operands, as ``inputs_name`` names it; fp8 may mix e4m3 and e5m2
GEMM_INPUT_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fn x float8_e5m2",
                     "float8_e5m2 x float8_e4m3fn")
GROUPED_INPUT_DTYPES = ("bfloat16", "float16")
OUTPUT_DTYPES = ("bfloat16", "float16", "float32")


def dtype_refusal(grouped: bool, in_dtype: str, out_dtype: str) -> str | None:
    """Why no kernel of any arch computes a (grouped) product of ``in_dtype`` operands into
    ``out_dtype``, or None."""
    inputs = GROUPED_INPUT_DTYPES if grouped else GEMM_INPUT_DTYPES
    if in_dtype not in inputs:
        return f"no {'grouped ' if grouped else ''}kernel takes {in_dtype} inputs (only {', '.join(inputs)})"
    if out_dtype not in OUTPUT_DTYPES:
        return f"no kernel writes {out_dtype} outputs (only {', '.join(OUTPUT_DTYPES)})"
    return None


# The dot algorithm presets the kernels compute exactly (operands as given, a float32
# accumulator); fp8 partial sums are not promoted per k-tile, cuBLAS's fast accumulation.
_KERNEL_ALGORITHMS = {"DEFAULT": None, "BF16_BF16_F32": ("bfloat16",), "F16_F16_F32": ("float16",),
                      "ANY_F8_ANY_F8_F32_FAST_ACCUM": ("float8_e4m3fn", "float8_e5m2")}


def algorithm_refusal(precision, in_dtype: str) -> str | None:
    """Why the kernels do not compute a product of ``in_dtype`` operands as ``precision`` (a
    ``lax.Precision`` pair, a ``DotAlgorithmPreset`` or a ``DotAlgorithm``) asks, or None.
    Precision hints only choose among f32 algorithms, which no kernel takes."""
    if precision is None or (isinstance(precision, tuple) and not hasattr(precision, "_fields")):
        return None
    name = getattr(precision, "name", None)
    if name in _KERNEL_ALGORITHMS and (_KERNEL_ALGORITHMS[name] is None or in_dtype in _KERNEL_ALGORITHMS[name]):
        return None
    return f"dot algorithm {precision} on {in_dtype} operands: only XLA implements it"


ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "int32": 4}


def stride_div(dtype: str) -> int:
    """Strides (in elements) must be multiples of this to stay 16-byte aligned."""
    return 16 // ITEMSIZE[dtype]


SCALE_K = 128  # K (and a weight's row) extent of one block scale (docs/fp8.md)


# A gated product's B scales per 64 columns of its paired view (``b_block`` PAIRED_BLOCK): a
# scaled tile's 128 columns are 64 gate and 64 up columns, each inside one 128 x 128 weight block
# when N / 2 is a multiple of 64, so the tile reads two scales a k-tile instead of 128 per-column
# ones. Row 2 t + h of ``sb`` scales columns [h N/2 + 64 t, h N/2 + 64 t + 64) (h: 0 gate, 1 up).
PAIRED_BLOCK = 64


def _check_blocks(a_block: int, b_block: int, activation: str) -> None:
    if (a_block == 0) != (b_block == 0) or a_block not in (0, 1, SCALE_K) \
            or b_block not in (0, 1, SCALE_K, PAIRED_BLOCK):
        raise ValueError(f"block scales take a_block and b_block in (1, {SCALE_K}) together, not "
                         f"{a_block} and {b_block}")
    if b_block == PAIRED_BLOCK and activation not in fused_epilogue.GATED:
        raise ValueError(f"B scales per {PAIRED_BLOCK} paired columns (b_block {PAIRED_BLOCK}) take a gated "
                         f"activation, not {activation!r}")


SCALE_ROWS = 4  # row blocks of block scales are padded to a multiple of this: 16-byte TMA strides


def _scale_args(scaled: bool) -> tuple[TensorArg, ...]:
    """The float32 block scales ``sa`` and ``sb``, (row blocks, Kb, batch) each, contiguous
    along the row blocks, their count padded to a multiple of SCALE_ROWS (the kernel loads them
    with TMA, whose strides are multiples of 16 bytes); none for an unscaled product."""
    rows = Dyn(SCALE_ROWS)
    return tuple(TensorArg(name, "float32", (rows, DYN, DYN), (1, rows, rows), align=16) for name in ("sa", "sb")) \
        if scaled else ()


def _operand(name: str, dtype: str, rank: int, major: int, aligned: bool = True) -> TensorArg:
    stride = tuple(1 if i == major else Dyn(stride_div(dtype) if aligned else 1) for i in range(rank))
    return TensorArg(name, dtype, (DYN,) * rank, stride, align=16)


# Kernels count extents and tiles in 32 bits: descriptor shapes are int32, tile counts and
# indices Int32, and rounding an extent up to whole tiles adds up to a tile, hence the margin.
MAX_EXTENT = 2**31 - 2**16
MAX_TILES = 2**31 - 1
RAGGED_EXTENT = 2**30   # a grouped launch's ragged mode (kernels/sm90_gemm.py's notes)
_SMALLEST_TILE = 64


def int32_refusal(m: int, n: int, k: int, l: int, g: int | None = None, ragged: str | None = None) -> str | None:
    """Why a problem of these extents is past the kernels' 32-bit arithmetic, or None.
    Grouped problems give ``g`` and their ragged mode (``"M"`` or ``"K"``)."""
    named = {"M": m, "N": n, "K": k, "L": l, **({} if g is None else {"G": g})}
    for name, v in named.items():
        if v > MAX_EXTENT:
            return f"{name}={v} is past the kernels' int32 extents (at most {MAX_EXTENT})"
    if ragged is not None and named[ragged] > RAGGED_EXTENT:
        return (f"{ragged}={named[ragged]} is past the grouped kernels' TMA extent for one group "
                f"({RAGGED_EXTENT} rows)")
    mt, nt = -(-m // _SMALLEST_TILE), -(-n // _SMALLEST_TILE)
    tiles = mt * nt * l if g is None else ((mt + g) * nt * l if ragged == "M" else g * mt * nt * l)
    if tiles > MAX_TILES:
        return f"{tiles} output tiles of {_SMALLEST_TILE}x{_SMALLEST_TILE} are past the kernels' int32 tile count"
    return None


def gated_output(shape: tuple[int, ...], stride: tuple[int, ...], major: str, padded: bool, n: int,
                 columns: int) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    """A gated activation's output as a kernel writes it, given C's flat (M, N, *batch) ``shape``
    and ``stride`` for the product's ``n`` columns: (shape, stride) of N/2 columns of an N-major
    C whose every other stride counts whole rows of N, or why the kernel cannot write it.
    ``columns``: the family's block of paired gate and up columns (its ``GATED_COLUMNS``);
    ``padded``: C's buffer was padded for alignment."""
    if major != "n" or padded:
        return "a gated output needs an unpadded C contiguous along N"
    if len(shape) > 3:
        return "a gated output takes one batch mode (the paired N spends three TMA dimensions)"
    if (n // 2) % columns:
        return f"kernels pair gate and up columns in blocks of {columns}: N/2 = {n // 2} is not a multiple"
    if any(s % n for i, (e, s) in enumerate(zip(shape, stride)) if i != 1 and e > 1):
        return "C's row strides are not whole multiples of N"
    # (an extent-1 mode's stride is never used; N/2 keeps it aligned)
    return ((shape[0], n // 2, *shape[2:]),
            tuple(1 if i == 1 else (s // 2 if s % n == 0 else n // 2) for i, s in enumerate(stride)))


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """Static part of a dense GEMM: dtypes and which mode of each operand is contiguous.

    ``a_major`` is "k" or "m", ``b_major`` "k" or "n", ``c_major`` "n" or "m".
    """

    a_dtype: str
    b_dtype: str
    c_dtype: str
    a_major: str = "k"
    b_major: str = "k"
    c_major: str = "n"
    acc_dtype: str = "float32"
    batch_modes: int = 1   # 1, or 3 (see the module notes)
    # Fused epilogue (families that declare EPILOGUES only): with ``bias`` the kernel takes a
    # float32 ``bias`` (N,) after c and computes C = act(A·B + bias[n]) in float32 before the
    # one rounding to c_dtype; ``activation`` is "" (none) or a name in the family's EPILOGUES.
    # ``preact`` (with an activation; families whose EPILOGUES name "preact"): the kernel also
    # writes the pre-activation A·B + bias, rounded once to c_dtype, to an output ``d`` laid
    # out like c (the residual a differentiated forward saves).
    # ``dact`` (families whose EPILOGUES name "dact"; alone, without bias or activation): an
    # activation name whose derivative scales the product, C = act'(z) * A·B in float32, with z
    # an input ``z`` laid out like c (the saved pre-activation): the gradient GEMM of
    # ``y = act(z)`` with the activation's backward fused.
    bias: bool = False
    activation: str = ""
    preact: bool = False
    dact: str = ""
    # Block-scaled fp8 (docs/fp8.md): rows of A (``a_block``) and of B (``b_block``) per float32
    # scale, 1 or 128 (a gated product's B: also PAIRED_BLOCK, in paired order); 0 for an
    # unscaled product. The kernel takes ``sa`` (ceil(M/a_block), Kb, L)
    # and ``sb`` (ceil(N/b_block), Kb, L), contiguous along their row blocks (their count padded to
    # a multiple of SCALE_ROWS), Kb = ceil(K/128), and adds each 128-K block's partial product times
    # sa[m] * sb[n] to its float32 accumulator.
    a_block: int = 0
    b_block: int = 0
    # C's strides are not multiples of 16 bytes (a 50257-word vocabulary's logits): the kernel
    # stores C with per-element stores instead of TMA (families with UNALIGNED_C; one batch
    # mode, no second output or Z read laid out like C).
    c_aligned: bool = True

    def __post_init__(self):
        if self.a_major not in ("k", "m") or self.b_major not in ("k", "n") or self.c_major not in ("n", "m"):
            raise ValueError(f"bad major-ness in {self}")
        if self.batch_modes not in (1, 3):
            raise ValueError(f"a GEMM takes 1 or 3 batch modes, not {self.batch_modes}")
        if self.preact and not self.activation:
            raise ValueError("a pre-activation output needs an activation (without one it equals c)")
        if self.dact and (self.bias or self.activation or self.preact):
            raise ValueError("an activation's derivative (dact) scales the bare product: no bias, activation "
                             "or preact with it")
        _check_blocks(self.a_block, self.b_block, self.activation)
        if not self.c_aligned and (self.preact or self.dact or self.batch_modes != 1 or self.scaled):
            raise ValueError("an unaligned C takes one batch mode, no pre-activation output, dact or block scales")

    @property
    def scaled(self) -> bool:
        return self.a_block > 0

    def key(self) -> str:
        return (f"{self.a_dtype}.{self.b_dtype}.{self.c_dtype}.acc{self.acc_dtype}."
                f"{self.a_major}{self.b_major}{self.c_major}" + (f".b{self.batch_modes}" if self.batch_modes > 1 else "")
                + (".bias" if self.bias else "") + (f".{self.activation}" if self.activation else "")
                + (".preact" if self.preact else "")
                + (f".dact-{self.dact}" if self.dact else "")
                + (f".scaled{self.a_block}x{self.b_block}" if self.scaled else "")
                + ("" if self.c_aligned else ".cunaligned"))

    def scale_args(self) -> tuple[TensorArg, ...]:
        """The float32 block scales ``sa`` (ceil(M/a_block), Kb, L) and ``sb`` (ceil(N/b_block),
        Kb, L), row blocks padded to a multiple of SCALE_ROWS (one batch mode: see
        sm90_gemm.unsupported)."""
        return _scale_args(self.scaled)

    def bias_arg(self) -> TensorArg:
        """The fused epilogue's bias: float32 (N,)."""
        return TensorArg("bias", "float32", (DYN,), (1,), align=4)

    def preact_arg(self) -> TensorArg:
        """The pre-activation output ``d``: c's dtype, rank and major mode."""
        return _operand("d", self.c_dtype, 2 + self.batch_modes, 1 if self.c_major == "n" else 0)

    def dact_arg(self) -> TensorArg:
        """The pre-activation input ``z`` of a dact epilogue: c's dtype, rank and major mode."""
        return _operand("z", self.c_dtype, 2 + self.batch_modes, 1 if self.c_major == "n" else 0)

    def signature(self, extra: tuple = ()) -> Signature:
        """(a (M,K,L...), b (N,K,L...), c (M,N,L...), *extra, stream)."""
        rank = 2 + self.batch_modes
        return (
            _operand("a", self.a_dtype, rank, 1 if self.a_major == "k" else 0),
            _operand("b", self.b_dtype, rank, 1 if self.b_major == "k" else 0),
            _operand("c", self.c_dtype, rank, 1 if self.c_major == "n" else 0, self.c_aligned),
            *extra,
            StreamArg(),
        )


@dataclasses.dataclass(frozen=True)
class GroupedSpec:
    """Static part of a grouped GEMM with group sizes read on the device.

    ``mode="ragged_m"`` (forward and lhs gradient): a (M,K,L), b (N,K,G,L), c (M,N,L),
    group_sizes (G,L) int32. Rows are split into consecutive groups; row m of batch l belongs
    to group g when off[g-1] <= m < off[g], off = clip(cumsum(max(group_sizes, 0)), 0, M), and
    ``c[m,n,l] = sum_k a[m,k,l] * b[n,k,g,l]``; rows m >= off[G-1] are written as zeros.

    ``mode="ragged_k"`` (rhs gradient): a (M,K,L), b (N,K,L), c (M,N,G,L), group_sizes (G,L);
    ``c[m,n,g,l] = sum over k in [off[g-1], off[g]) of a[m,k,l] * b[n,k,l]``, zero for empty
    groups. Here K is the ragged (token) mode.

    Any operand, group_sizes included, may have L extent 1 (broadcast over batches).

    ``lead`` (ragged_dot's group_offset): group_sizes is (G + 1, L), its first size a lead of
    rows (tokens) that no group takes, before group 0: ragged_m writes zeros there with no
    product (and no bias), ragged_k sums none of them.

    Fused epilogue (ragged_m; families whose EPILOGUES name them), as GemmSpec's with a bias per
    group: ``bias`` adds a float32 ``bias`` (N, G, L) (row (g, l) for the rows of group g in batch
    l; L extent 1: one bias for every batch; the zero rows past the last group take none), ``activation`` and ``preact`` as GemmSpec's, the
    pre-activation ``d`` laid out like c (with a gated activation, like c's N columns).

    Block-scaled fp8 (one batch; docs/fp8.md): ragged_m with ``a_block`` 1 and ``b_block`` 1 or 128
    (gated: or PAIRED_BLOCK) as GemmSpec's, ``sa`` (M, Kb, 1) and ``sb`` (ceil(N/b_block), Kb, G) after the group sizes
    (row blocks padded to a multiple of SCALE_ROWS, as GemmSpec's); ragged_k with ``a_block`` and
    ``b_block`` 1, A and B contiguous along K, ``sa`` (M, Kb, 1) and ``sb`` (N, Kb, 1), where every
    group starts at a multiple of 128 of K: group g's k-range is [128 f_g, 128 f_g + size_g), f_g =
    sum over h < g of ceil(size_h / 128), zero-filled up to its next multiple of 128 (the caller
    lays K out so), and its k-tile j takes scale block f_g + j.
    """

    mode: str
    a_dtype: str
    b_dtype: str
    c_dtype: str
    a_major: str = "k"
    b_major: str = "k"
    c_major: str = "n"
    acc_dtype: str = "float32"
    bias: bool = False
    activation: str = ""
    preact: bool = False
    a_block: int = 0
    b_block: int = 0
    lead: bool = False

    def __post_init__(self):
        if (self.bias or self.activation) and self.mode != "ragged_m":
            raise ValueError(f"a fused grouped epilogue needs mode ragged_m, not {self.mode}")
        _check_blocks(self.a_block, self.b_block, self.activation)
        if self.a_block and (self.a_block != 1 or (self.mode == "ragged_k" and self.b_block != 1)):
            raise ValueError(f"a block-scaled grouped product takes 1 x 128 A scales (ragged_k: B's too), not {self}")
        if self.preact and not self.activation:
            raise ValueError("a pre-activation output needs an activation (without one it equals c)")

    @property
    def scaled(self) -> bool:
        return self.a_block > 0

    def key(self) -> str:
        return (f"{self.mode}.{self.a_dtype}.{self.b_dtype}.{self.c_dtype}.acc{self.acc_dtype}."
                f"{self.a_major}{self.b_major}{self.c_major}"
                + (".bias" if self.bias else "") + (f".{self.activation}" if self.activation else "")
                + (".preact" if self.preact else "") + (".lead" if self.lead else "")
                + (f".scaled{self.a_block}x{self.b_block}" if self.scaled else ""))

    def signature(self, extra: tuple = ()) -> Signature:
        a = _operand("a", self.a_dtype, 3, 1 if self.a_major == "k" else 0)
        if self.mode == "ragged_m":
            b = _operand("b", self.b_dtype, 4, 1 if self.b_major == "k" else 0)
            c = _operand("c", self.c_dtype, 3, 1 if self.c_major == "n" else 0)
        elif self.mode == "ragged_k":
            b = _operand("b", self.b_dtype, 3, 1 if self.b_major == "k" else 0)
            c = _operand("c", self.c_dtype, 4, 1 if self.c_major == "n" else 0)
        else:
            raise ValueError(f"unknown grouped mode {self.mode!r}")
        gs = TensorArg("group_sizes", "int32", (DYN, DYN), (1, DYN), align=4)
        fused = (TensorArg("bias", "float32", (DYN, DYN, DYN), (1, DYN, DYN), align=4),) if self.bias else ()
        if self.preact:
            fused += (_operand("d", self.c_dtype, 3, 1 if self.c_major == "n" else 0),)
        return (a, b, c, gs, *_scale_args(self.scaled), *fused, *extra, StreamArg())


@dataclasses.dataclass(frozen=True)
class Workspace:
    """An extra device buffer a kernel needs; XLA allocates it as an extra output."""

    name: str
    nbytes: int
    zeroed: bool = False

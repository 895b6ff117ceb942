"""jax_cute.cute_call on the CPU: reference path, CUDA lowering for sm_90a, and its errors."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute
from jax_cute import config
from jax_cute.kernels.build import KernelCompileError

_EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "custom_kernel.py"
_spec = importlib.util.spec_from_file_location("custom_kernel_example", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def call_for(n: int, dtype=jnp.float32, **kw):
    return jax_cute.cute_call(example.axpby_launcher, out_shape=jax.ShapeDtypeStruct((n,), dtype),
                              reference=example._axpby_reference, name="axpby", **kw)


def args(n: int, dtype=jnp.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal(n), dtype)
    b = jnp.asarray(rng.standard_normal(n), dtype)
    return a, b, jnp.asarray([1.5], jnp.float32)


def cuda_text(f, *xs) -> str:
    with config.override(target_arch="sm_90a"):
        return jax.jit(f).trace(*xs).lower(lowering_platforms=("cuda",)).as_text()


def test_reference_path_on_cpu():
    a, b, alpha = args(1000)
    out = jax.jit(call_for(1000))(a, b, alpha)
    np.testing.assert_allclose(out, a * 1.5 + b, rtol=1e-6, atol=1e-6)


def test_no_reference_on_cpu_is_a_clear_error():
    f = jax_cute.cute_call(example.axpby_launcher, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), name="nref")
    with pytest.raises(NotImplementedError, match="runs only on CUDA GPUs; pass reference="):
        jax.jit(f)(*args(8))


@pytest.mark.parametrize("n", [8, 1000, 4099])
def test_lowers_to_our_custom_call_for_sm90(n):
    text = cuda_text(call_for(n), *args(n))
    assert text.count("@jax_cute_launch") == 1
    assert "arch_major = 9" in text


def test_partitioned_reference_needs_a_reference():
    # (its lowering under a partitioned jit: tests/test_fp8_sharded.py, on 8 host devices)
    with pytest.raises(ValueError, match="partitioned_reference=True needs a reference"):
        jax_cute.cute_call(example.axpby_launcher, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                           partitioned_reference=True)
    assert call_for(8, partitioned_reference=True) is not None


def test_permuted_layout_reaches_the_kernel_as_strides():
    f = jax_cute.cute_call(example.axpby_launcher, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                           in_layouts=[(0,), (0,), None], reference=example._axpby_reference)
    assert "@jax_cute_launch" in cuda_text(f, *args(16))
    with pytest.raises(ValueError, match="permutation of 1 axes"):
        jax_cute.cute_call(example.axpby_launcher, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                           in_layouts=[(1,), None, None])(*args(16))


def test_an_extent_one_axis_keeps_its_compact_stride():
    """A kernel sees row-major strides, an extent-1 axis included (its index is always 0, but a
    stride of 1 there would leave a slice along it without provable 16-byte alignment)."""
    from jax_cute.primitives.cute_call import _perm_layout, _signature

    assert _perm_layout((1, 256, 384), None) == ((1, 256, 384), (256 * 384, 384, 1))
    assert _perm_layout((4, 1, 8), (2, 0, 1)) == ((8, 4, 1), (1, 8, 8))
    assert _perm_layout((3, 0, 5), None) == ((3, 0, 5), (1, 5, 1))
    sig = _signature([jax.ShapeDtypeStruct((1, 16, 1), jnp.float32)], [], [None], [])
    assert sig[1].stride == (16, 1, 1)


def test_wrong_number_of_arguments_names_the_counts():
    with pytest.raises(TypeError, match=r"takes 5 arguments .* 2 inputs"):
        call_for(8)(*args(8)[:2])


def test_unsupported_dtype_names_the_argument():
    a, b, alpha = args(8)
    with pytest.raises(TypeError, match="argument 'a' has dtype complex64"):
        call_for(8)(a.astype(jnp.complex64), b, alpha)


def test_no_derivative_points_to_custom_vjp():
    a, b, alpha = args(8)
    with pytest.raises(NotImplementedError, match="custom_vjp"):
        jax.grad(lambda x: call_for(8)(x, b, alpha).sum())(a)


def test_vmap_loops_over_the_batch():
    a, b, alpha = args(3 * 8)
    a, b = a.reshape(3, 8), b.reshape(3, 8)
    f = jax.vmap(call_for(8), in_axes=(0, 0, None))
    np.testing.assert_allclose(jax.jit(f)(a, b, alpha), a * 1.5 + b, rtol=1e-6, atol=1e-6)
    assert "@jax_cute_launch" in cuda_text(f, a, b, alpha)


def test_outputs_vary_as_their_inputs_inside_shard_map():
    """With check_vma, a call's outputs vary over the manual axes its inputs vary over, so they
    mix with the body's other values (and a custom_vjp's types check) as an elementwise op's."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    a, b, alpha = args(16)
    seen = []

    def body(a, b, alpha):
        out = call_for(16)(a, b, alpha)
        seen.append(jax.typeof(out).mat.varying)
        return out

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=P("x"), check_vma=True)
    np.testing.assert_allclose(jax.jit(f)(a, b, alpha), a * 1.5 + b, rtol=1e-6, atol=1e-6)
    assert seen == [frozenset({"x"})], seen


def test_identity_is_the_source_not_the_object():
    from jax_cute.primitives.cute_call import _identity

    assert _identity(example.axpby_launcher, None) == _identity(example.axpby_launcher, None)
    assert "#key=v2" in _identity(example.axpby_launcher, "v2")


def test_nan_fill_aliases_prefilled_outputs():
    with config.override(nan_fill=True):
        text = cuda_text(call_for(64), *args(64))
    assert "output_operand_aliases" in text and "dense<0x7FC00000>" in text  # f32 NaN


def _launch_line(text: str) -> str:
    return next(line for line in text.splitlines() if "@jax_cute_launch" in line)


def test_in_place_output_is_aliased_to_its_input():
    f = lambda a, b, alpha: example.axpby_raw(a, b, alpha, in_place=True)  # noqa: E731
    with config.override(nan_fill=True):
        line = _launch_line(cuda_text(f, *args(64)))
    # operand 0 (a) holds the output; no NaN-filled buffer for it, even in nan_fill mode
    assert re.search(r"output_operand_alias<output_tuple_indices = \[\],\s*operand_index = 0,", line), line
    assert line.count("output_operand_alias<") == 1
    a, b, alpha = args(1000)
    out = jax.jit(f)(a, b, alpha)
    np.testing.assert_allclose(out, a * 1.5 + b, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(a, args(1000)[0])  # the caller's array is not written


def test_in_place_under_vmap_in_both_batch_modes():
    a, b, alpha = args(3 * 8)
    a, b = a.reshape(3, 8), b.reshape(3, 8)
    for batch_mode in (False, True):
        f = jax.vmap(call_for(8, input_output_aliases={0: 0}, batch_mode=batch_mode), in_axes=(0, 0, None))
        np.testing.assert_allclose(jax.jit(f)(a, b, alpha), a * 1.5 + b, rtol=1e-6, atol=1e-6)
        assert "operand_index = 0" in _launch_line(cuda_text(f, a, b, alpha))


@pytest.mark.parametrize("out_dtype, aliases, match", [
    (jnp.float32, {2: 0}, r"input 2 \(float32\[1\]\) cannot hold output 0 \(float32\[8\]\)"),
    (jnp.bfloat16, {0: 0}, r"input 0 \(float32\[8\]\) cannot hold output 0 \(bfloat16\[8\]\)"),
    (jnp.float32, {0: 1}, r"\{0: 1\} is out of range \(3 inputs, 1 outputs\)"),
    (jnp.float32, {0: 0, 1: 0}, "maps two inputs to one output"),
])
def test_bad_aliases_are_named(out_dtype, aliases, match):
    with pytest.raises(ValueError, match=match):
        call_for(8, dtype=out_dtype, input_output_aliases=aliases)(*args(8))


@cute.jit
def _broken_launcher(stream, a: cute.Tensor, out: cute.Tensor):
    out[0] = a[0] * cutlass.Float32(2.0)  # f32 into an f16 tensor: the DSL refuses it


def test_compile_error_carries_the_dsl_message():
    f = jax_cute.cute_call(_broken_launcher, out_shape=jax.ShapeDtypeStruct((8,), jnp.float16))
    with pytest.raises(KernelCompileError, match="Type mismatch"):
        cuda_text(f, jnp.zeros((8,), jnp.float16))


# -- the disk cache keys a launcher on the code it compiles -------------------------------------

_USER_KERNELS = '''
import cutlass
import cutlass.cute as cute

SCALE = {scale}


@cute.kernel
def body(x: cute.Tensor, y: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    y[tidx] = x[tidx] * {expr}


@cute.jit
def launcher(stream, x: cute.Tensor, y: cute.Tensor):
    body(x, y).launch(grid=(1, 1, 1), block=(8, 1, 1), stream=stream)
'''


def _load_user_module(tmp_path, expr: str, scale: int = 1):
    """``user_kernels`` from a file, as a new process would import it after an edit."""
    path = tmp_path / "user_kernels.py"
    path.write_text(_USER_KERNELS.format(expr=expr, scale=scale))
    spec = importlib.util.spec_from_file_location("user_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiles_in_a_new_process(launcher, cache_dir, monkeypatch) -> int:
    """How many compiles a fresh in-memory cache needs to lower ``launcher`` (disk shared)."""
    from jax_cute import cache, dispatch
    from jax_cute.primitives.cute_call import _identity, _signature

    fresh = cache.KernelCache()
    monkeypatch.setattr(dispatch, "CACHE", fresh)
    monkeypatch.setattr(dispatch, "compile_launcher", lambda launcher, sig, arch, name: _FakeBinary(name, sig))
    sds = jax.core.ShapedArray((8,), jnp.float32)
    with config.override(target_arch="sm_90a", cache_dir=str(cache_dir), disk_cache=True):
        dispatch.user_kernel("k", _identity(launcher, None), launcher, _signature([sds], [sds], [None], [None]), True)
    return fresh.stats.compiles


def _FakeBinary(name, sig):
    from jax_cute.kernels.build import KernelBinary
    return KernelBinary(name=name, symbol="jc_k", arch="sm_90a", signature=sig, obj=b"\x7fELF" + name.encode())


@pytest.mark.parametrize("edit", [dict(expr="cutlass.Float32(3.0) + cutlass.Float32(7.0)"),
                                  dict(expr="cutlass.Float32(SCALE)", scale=2)])
def test_an_edited_kernel_the_launcher_calls_is_compiled_again(tmp_path, monkeypatch, edit):
    """The launcher's own source is unchanged; the @cute.kernel it calls (or a constant that
    kernel reads) changed: the next process must not load the old object from disk."""
    cache_dir = tmp_path / "cache"
    v1 = _load_user_module(tmp_path, "cutlass.Float32(SCALE)")
    assert _compiles_in_a_new_process(v1.launcher, cache_dir, monkeypatch) == 1
    assert _compiles_in_a_new_process(v1.launcher, cache_dir, monkeypatch) == 0  # from disk
    v2 = _load_user_module(tmp_path, **edit)
    assert _compiles_in_a_new_process(v2.launcher, cache_dir, monkeypatch) == 1


class _Opaque:
    factor = 2.0


_OPAQUE = _Opaque()


@cute.jit
def _opaque_launcher(stream, a: cute.Tensor, out: cute.Tensor):
    out[0] = a[0] * _OPAQUE.factor


def test_a_launcher_that_cannot_be_keyed_is_cached_in_memory_only(tmp_path, monkeypatch, caplog):
    from jax_cute.launcher_code import launcher_digest

    digest, why = launcher_digest(_opaque_launcher)
    assert digest is None and "_OPAQUE" in why and "_Opaque object" in why
    assert _compiles_in_a_new_process(_opaque_launcher, tmp_path, monkeypatch) == 1
    assert _compiles_in_a_new_process(_opaque_launcher, tmp_path, monkeypatch) == 1
    assert not list(tmp_path.iterdir())
    assert any("kept in memory only" in r.getMessage() and "_OPAQUE" in r.getMessage() for r in caplog.records)


_WALKED = '''
import functools
import math
import helpers_mod as helpers

TABLE = {{"tile": {tile}}}


def scale(x, s):
    return x * s


SCALED = functools.partial(scale, s={s})


def make(offset):
    def launcher(stream, x, y):
        return SCALED(x) + helpers.bump(y) + TABLE["tile"] + offset + math.pi
    return launcher


launcher = make({offset})
'''


@pytest.mark.parametrize("change", ["tile", "s", "offset", "bump"])
def test_the_launcher_digest_covers_what_its_code_reaches(tmp_path, monkeypatch, change):
    """Globals, closure cells, functools.partial arguments and functions of user modules the
    code names are all keyed; a library (math) is not walked."""
    import sys

    from jax_cute.launcher_code import launcher_digest

    def digest(version: str, **kw) -> str:
        """The digest of module ``walked`` (and its ``helpers_mod``) as a new process would load it."""
        values = dict(tile=128, s=2, offset=7, bump="y + 1") | kw
        where = tmp_path / version
        where.mkdir()
        (where / "helpers_mod.py").write_text(f"def bump(y):\n    return {values.pop('bump')}\n")
        (where / "walked.py").write_text(_WALKED.format(**values))
        monkeypatch.syspath_prepend(str(where))
        for name in ("walked", "helpers_mod"):
            monkeypatch.delitem(sys.modules, name, raising=False)
        got, why = launcher_digest(importlib.import_module("walked").launcher)
        assert got is not None, why
        return got

    base = digest("a")
    assert digest("same") == base
    changed = {"tile": dict(tile=64), "s": dict(s=3), "offset": dict(offset=8), "bump": dict(bump="y + 2")}[change]
    assert digest("changed", **changed) != base

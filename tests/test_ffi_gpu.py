"""GPU tests of the jax_cute_launch FFI handler, driven directly through jax.ffi.ffi_call.

A tiny element-wise CuTe DSL launcher (y = 2x + 1) is compiled for sm_90a in this process, so
the DSL compiler (``import cutlass``) must be importable; the tests skip without it. Every test
here needs an NVIDIA GPU (marker ``gpu``).
"""

from __future__ import annotations

import dataclasses
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jax_cute import runtime
from jax_cute.kernels import abi
from concurrently import run_concurrently

pytestmark = pytest.mark.gpu

JaxRuntimeError = getattr(jax.errors, "JaxRuntimeError", Exception)

SIZES = [1, 127, 128, 129, 4096, 1_000_003]  # includes non-multiples of the kernel's 128-wide block


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def _capability(device) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if not cc:
        return None
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)


def _arch_numbers(arch: str) -> tuple[int, int]:
    """'sm_90a' -> (9, 0), 'sm_100a' -> (10, 0)."""
    m = re.fullmatch(r"sm_(\d+)(\d)[a-z]?", arch)
    assert m, arch
    return int(m.group(1)), int(m.group(2))


def _compile(name: str, arch: str = "sm_90a"):
    """The y = 2x + 1 test kernel compiled for ``arch`` under a unique ``name`` (a unique key)."""
    pytest.importorskip("cutlass", reason="the CuTe DSL compiler is not installed")
    from affine_kernel import compile_affine

    return compile_affine(name, arch)


def affine(binary, x, *, symbol: str | None = None, x_align: int | None = None,
           arch: tuple[int, int] | None = None):
    """y = 2x + 1 through the jax_cute_launch custom call (call inside jax.jit).

    ``symbol``, ``x_align`` and ``arch`` override what the call declares, to test the checks.
    """
    signature = binary.signature
    if x_align is not None:  # same object, stricter alignment demanded of x
        signature = (dataclasses.replace(signature[0], align=x_align),) + tuple(signature[1:])
    n = x.shape[0]
    packed = abi.pack_args(signature, ["x", "y"], {"x": ((n,), (1,)), "y": ((n,), (1,))})
    major, minor = arch or _arch_numbers(binary.arch)
    return jax.ffi.ffi_call(runtime.TARGET_NAME, jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, name=binary.name, key=binary.digest, symbol=symbol or binary.symbol,
        object=np.frombuffer(binary.obj, np.uint8), arch_major=major, arch_minor=minor,
        **packed.attributes())


def reference(x):
    return x * 2 + 1


@pytest.fixture(scope="module", autouse=True)
def _gpu_and_registration():
    gpus = _gpus()
    if not gpus:
        pytest.skip("no NVIDIA GPU visible to JAX")
    if _capability(gpus[0]) not in (None, (9, 0)):
        pytest.skip(f"the test kernel is compiled for sm_90a; device is {gpus[0].compute_capability}")
    runtime.ensure_registered()


@pytest.fixture(scope="module")
def binary():
    return _compile("test/affine")


@pytest.fixture(scope="module")
def affine_jit(binary):
    return jax.jit(lambda x: affine(binary, x))


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-4, 4, size=n).astype(np.float32)


@pytest.mark.parametrize("n", SIZES)
def test_matches_jnp_exactly(affine_jit, n):
    x = jnp.asarray(_random(n, seed=n))
    y = affine_jit(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(reference)(x)))


def test_two_calls_in_one_jit(binary):
    f = jax.jit(lambda x: affine(binary, affine(binary, x)) - x)
    x = jnp.asarray(_random(1000, seed=1))
    np.testing.assert_array_equal(np.asarray(f(x)),
                                  np.asarray(jax.jit(lambda x: reference(reference(x)) - x)(x)))


def test_inside_fori_loop(binary):
    steps = 7

    @jax.jit
    def looped(x):
        return lax.fori_loop(0, steps, lambda i, v: affine(binary, v), x)

    @jax.jit
    def expected(x):
        return lax.fori_loop(0, steps, lambda i, v: reference(v), x)

    for n in (129, 4096):
        x = jnp.asarray(np.random.default_rng(n).uniform(-1, 1, size=n).astype(np.float32))
        np.testing.assert_array_equal(np.asarray(looped(x)), np.asarray(expected(x)))


def test_two_threads_at_once(affine_jit):
    n, rounds = 100_003, 20
    affine_jit(jnp.zeros((n,), jnp.float32)).block_until_ready()  # compile outside the race
    barrier = threading.Barrier(2)
    failures: list[BaseException] = []

    def worker(seed: int):
        try:
            rng = np.random.default_rng(seed)
            barrier.wait()
            for _ in range(rounds):
                x = rng.uniform(-4, 4, size=n).astype(np.float32)
                y = np.asarray(affine_jit(jnp.asarray(x)))
                np.testing.assert_array_equal(y, x * np.float32(2) + np.float32(1))
        except BaseException as e:  # reported in the main thread
            failures.append(e)

    run_concurrently(worker, [(11,), (12,)])
    assert not failures, failures


def test_one_module_per_device():
    fresh = _compile("test/affine_stats")  # a new object: a new registry key
    f = jax.jit(lambda x: affine(fresh, x))
    devices = [d for d in _gpus() if _capability(d) in (None, (9, 0))]
    before = runtime.stats()
    for device in devices:
        for n in (1000, 2000, 2000):  # two shapes: two executables, one module
            x = jax.device_put(_random(n, seed=n), device)
            y = f(x)
            assert next(iter(y.devices())) == device
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * np.float32(2) + np.float32(1))
    after = runtime.stats()
    assert after["modules_created"] - before["modules_created"] == len(devices)
    assert after["functions_loaded"] - before["functions_loaded"] == len(devices)
    # Each call launches once unless XLA replays it from a CUDA graph (no handler call then).
    assert 1 <= after["launches"] - before["launches"] <= 3 * len(devices)


def test_concurrent_first_calls_load_one_module():
    fresh = _compile("test/affine_race")  # a new object: nothing loaded for it yet
    f = jax.jit(lambda x: affine(fresh, x))
    # Four shapes: four executables, each running the handler's initialize on its first call.
    xs = [jnp.asarray(_random(n, seed=n)) for n in (1000, 1001, 1002, 1003)]

    def check(x):
        np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x) * np.float32(2) + np.float32(1))

    before = runtime.stats()
    run_concurrently(check, [(x,) for x in xs])
    after = runtime.stats()
    # Whatever the interleaving, the process loads the object once for the device.
    assert after["modules_created"] - before["modules_created"] == 1
    assert after["functions_loaded"] - before["functions_loaded"] == 1


def test_misaligned_pointer_is_an_error_and_process_survives(binary):
    # No real pointer is aligned to 2**62 bytes, so the check must refuse to launch.
    f = jax.jit(lambda x: affine(binary, x, x_align=1 << 62))
    x = jnp.asarray(_random(1000, seed=3))
    with pytest.raises(JaxRuntimeError) as info:
        jax.block_until_ready(f(x))
    message = str(info.value)
    assert "aligned" in message and str(1 << 62) in message
    assert binary.name in message and "argument 0" in message
    # The process and the kernel still work.
    g = jax.jit(lambda x: affine(binary, x))
    np.testing.assert_array_equal(np.asarray(g(x)), np.asarray(reference(x)))


@pytest.mark.parametrize("symbol", ["jc_no_such_kernel", "jc_test", "jc_test_affine_"])
def test_wrong_symbol_is_an_error_not_an_abort(binary, symbol):
    f = jax.jit(lambda x: affine(binary, x, symbol=symbol))
    x = jnp.asarray(_random(256, seed=4))
    with pytest.raises(JaxRuntimeError) as info:
        jax.block_until_ready(f(x))
    assert symbol in str(info.value)
    assert binary.name in str(info.value)


def test_wrong_arch_is_an_error(binary):
    # Declare the loaded sm_90a object as sm_100a: the check is per call site, so it must
    # refuse even though the module is already loaded for this device.
    affine_ok = jax.jit(lambda x: affine(binary, x))
    x = jnp.asarray(_random(256, seed=5))
    affine_ok(x).block_until_ready()
    f = jax.jit(lambda x: affine(binary, x, arch=(10, 0)))
    with pytest.raises(JaxRuntimeError) as info:
        jax.block_until_ready(f(x))
    message = str(info.value)
    assert "compiled for sm_100" in message and "compute capability 9.0" in message
    assert binary.name in message


def _raw_call(binary, x, n: int, out_shape, out_dtype):
    """The affine kernel's custom call with descriptors packed for ``n`` float32 elements each,
    whatever ``x`` and the output really are (as a hand-made or tampered module might)."""
    packed = abi.pack_args(binary.signature, ["x", "y"], {"x": ((n,), (1,)), "y": ((n,), (1,))})
    major, minor = _arch_numbers(binary.arch)
    return jax.ffi.ffi_call(runtime.TARGET_NAME, jax.ShapeDtypeStruct(out_shape, out_dtype))(
        x, name=binary.name, key=binary.digest, symbol=binary.symbol, object=np.frombuffer(binary.obj, np.uint8),
        arch_major=major, arch_minor=minor, **packed.attributes())


@pytest.mark.parametrize("case,says", [
    ("short_input", "argument 0 ('x', buffer 0) has 2048 bytes; its descriptor reaches 4096"),
    ("short_output", "argument 1 ('y', buffer 1) has 2048 bytes; its descriptor reaches 4096"),
    ("int_input", "argument 0 ('x', buffer 0) is a rank-1 buffer of dtype 4"),
    ("rank_2_input", "argument 0 ('x', buffer 0) is a rank-2 buffer of dtype 11"),
])
def test_buffers_unlike_their_descriptors_are_an_error(binary, case, says):
    """The handler compares every buffer's size, dtype and rank with the descriptor it fills,
    and names the argument, instead of letting the kernel read or write past a buffer."""
    n = 1024
    x = {"short_input": jnp.ones((n // 2,), jnp.float32), "int_input": jnp.ones((n,), jnp.int32),
         "rank_2_input": jnp.ones((n // 2, 2), jnp.float32)}.get(case, jnp.ones((n,), jnp.float32))
    out = (n // 2,) if case == "short_output" else (n,)
    with pytest.raises(JaxRuntimeError) as info:
        jax.block_until_ready(jax.jit(lambda x: _raw_call(binary, x, n, out, jnp.float32))(x))
    assert says in str(info.value) and binary.name in str(info.value)


def test_a_key_that_is_not_the_objects_digest_is_an_error(binary):
    x = jnp.ones((256,), jnp.float32)
    packed = abi.pack_args(binary.signature, ["x", "y"], {"x": ((256,), (1,)), "y": ((256,), (1,))})
    major, minor = _arch_numbers(binary.arch)
    call = jax.ffi.ffi_call(runtime.TARGET_NAME, jax.ShapeDtypeStruct((256,), jnp.float32))
    f = jax.jit(lambda x: call(x, name=binary.name, key="0" * 64, symbol=binary.symbol,
                               object=np.frombuffer(binary.obj, np.uint8), arch_major=major, arch_minor=minor,
                               **packed.attributes()))
    with pytest.raises(JaxRuntimeError, match="is not the sha256 of its object"):
        jax.block_until_ready(f(x))

"""CPU tests of jax_cute.runtime and the jax_cute._ffi extension (no GPU needed)."""

from __future__ import annotations

import ctypes.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cute import runtime
from jax_cute.kernels import abi
from concurrently import run_concurrently

SIGNATURE = (
    abi.TensorArg("x", "float32", (abi.DYN,), (1,)),
    abi.TensorArg("y", "float32", (abi.DYN,), (1,)),
    abi.StreamArg(),
)


def _launch(x, *, obj: bytes, symbol: str = "jc_test_affine"):
    """A jax_cute_launch custom call binding x -> y, as the primitives emit it."""
    n = x.shape[0]
    packed = abi.pack_args(SIGNATURE, ["x", "y"], {"x": ((n,), (1,)), "y": ((n,), (1,))})
    return jax.ffi.ffi_call(runtime.TARGET_NAME, jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, name="test/affine", key="ab" * 32, symbol=symbol, object=np.frombuffer(obj, np.uint8),
        arch_major=9, arch_minor=0, **packed.attributes())


def test_extension_imports():
    ext = runtime.extension()
    for name in ("set_runtime_library", "registrations", "stats", "state_type"):
        assert hasattr(ext, name), name
    assert set(ext.registrations()) == {"instantiate", "initialize", "execute"}
    assert set(ext.state_type()) == {"type_id", "type_info"}


def test_runtime_library_exists():
    path = runtime.dsl_runtime_library()
    assert os.path.isfile(path)
    assert os.path.basename(path) == "libcute_dsl_runtime.so"
    assert os.sep + "cu13" + os.sep in path  # the flavour we pin is preferred


def test_runtime_library_loads_without_gpu():
    runtime.ensure_registered()  # dlopens the DSL runtime: no CUDA needed
    ext = runtime.extension()
    path = runtime.dsl_runtime_library()
    ext.set_runtime_library(path)  # the loaded path again: fine
    with pytest.raises(RuntimeError, match="already loaded from " + re.escape(path)):
        ext.set_runtime_library("/nonexistent/libcute_dsl_runtime.so")


# The extension alone, without the package (whose import loads the real runtime first).
_LOADER_PROBE = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("jax_cute._ffi", sys.argv[1])
ext = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ext)
out = []
for path in sys.argv[2:]:
    try:
        ext.set_runtime_library(path)
        out.append("ok")
    except RuntimeError as e:
        out.append(str(e))
print("RESULT" + json.dumps(out))
"""


def test_loader_errors_name_the_library_and_every_missing_symbol():
    libm = ctypes.util.find_library("m")
    real = runtime.dsl_runtime_library()
    paths = ["/nonexistent/libcute_dsl_runtime.so", libm, real, real, libm]
    proc = subprocess.run([sys.executable, "-c", _LOADER_PROBE, runtime.extension().__file__, *paths],
                          capture_output=True, text=True, timeout=120)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    absent, lacking, first, again, switch = json.loads(lines[-1][len("RESULT"):])
    assert "cannot load /nonexistent/libcute_dsl_runtime.so" in absent
    assert f"{libm} lacks " in lacking
    for name in ("Module_Create_From_Bytes", "Module_Get_Function", "Function_Run", "Module_Destroy",
                 "GetErrorName", "GetErrorString"):
        assert "CuteDSLRT_" + name in lacking, name
    assert first == again == "ok"  # a failed load leaves nothing behind; the same path twice is fine
    assert f"already loaded from {real}" in switch


def test_registration_is_idempotent_and_thread_safe():
    errors = []

    def register():
        try:
            runtime.ensure_registered()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    run_concurrently(register, [()] * 8)
    runtime.ensure_registered()
    assert not errors


def test_stats_start_at_zero_without_gpu():
    stats = runtime.stats()
    assert set(stats) == {"modules_created", "functions_loaded", "launches"}
    assert all(isinstance(v, int) and v >= 0 for v in stats.values())


def test_lowering_for_cuda_emits_the_custom_call():
    runtime.ensure_registered()
    x = jnp.zeros((1000,), jnp.float32)
    obj = b"\x7fELF" + bytes(60)
    text = jax.jit(lambda x: _launch(x, obj=obj)).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.custom_call @jax_cute_launch" in text
    for attr in ("name = \"test/affine\"", "symbol = \"jc_test_affine\"", "arch_major = 9",
                 "arch_minor = 0", "arg_kinds", "arg_offsets", "arg_words", "arg_align",
                 "key = \"" + "ab" * 32 + "\"", "object = dense<"):
        assert attr in text, attr
    # The descriptor of x holds its dynamic extent (word 1) after the pointer word.
    assert "arg_words = dense<[0, 1000, 0, 1000, 0]>" in text
    assert "arg_kinds = dense<[0, 1, -1]>" in text


def _compile_affine(name: str):
    """The y = 2x + 1 test kernel compiled for sm_90a; needs the DSL compiler."""
    pytest.importorskip("cutlass", reason="the CuTe DSL compiler is not installed")
    from affine_kernel import compile_affine

    return compile_affine(name)


# The instantiate stage runs on any backend, so XLA:CPU can exercise our attribute decoding and
# validation. It runs in a fresh CPU-only process: the handler's state type may be registered
# with one XLA per process only, and here it goes to XLA:CPU instead of the CUDA plugin.
_CPU_PROBE = r"""
import hashlib, json, sys
import jax, numpy as np
from jax_cute import runtime
from jax_cute.kernels import abi

jax.devices("cpu")  # XLA:CPU takes handlers before types: let it start first
ext = runtime.extension()
jax.ffi.register_ffi_type("jax_cute_probe_state", ext.state_type(), platform="cpu")
jax.ffi.register_ffi_target("jax_cute_probe", ext.registrations(), platform="cpu", api_version=1)

sig = (abi.TensorArg("x", "float32", (abi.DYN,), (1,)), abi.TensorArg("y", "float32", (abi.DYN,), (1,)),
       abi.StreamArg())
packed = abi.pack_args(sig, ["x", "y"], {"x": ((8,), (1,)), "y": ((8,), (1,))})
base = dict(name="test/affine", arch_major=9, arch_minor=0, **packed.attributes())
x = jax.numpy.zeros(8, jax.numpy.float32)
call = jax.ffi.ffi_call("jax_cute_probe", jax.ShapeDtypeStruct(x.shape, x.dtype))
out = {}
for case, over in json.load(open(sys.argv[1])).items():
    attrs = {**base, **{k: np.array(v, np.int64) if isinstance(v, list) else v for k, v in over.items()}}
    attrs["object"] = np.fromfile(attrs["object"], np.uint8)
    attrs.setdefault("key", hashlib.sha256(attrs["object"].tobytes()).hexdigest())
    try:
        jax.jit(lambda x: call(x, **attrs))(x).block_until_ready()
        out[case] = "ok"
    except Exception as e:
        out[case] = str(e)
print("RESULT" + json.dumps(out))
"""


def _instantiate_on_cpu(tmp_path, cases: dict[str, dict]) -> dict[str, str]:
    """Each case's outcome (its error message) for a call x -> y whose attributes the case
    overrides; a case's "object" names the file that holds the object."""
    cases_path = tmp_path / "cases.json"
    cases_path.write_text(json.dumps(cases))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _CPU_PROBE, str(cases_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


def test_instantiate_rejects_objects_without_the_function(tmp_path):
    fakes = {"empty": b"", "elf_header_only": b"\x7fELF" + bytes(200),
             "names_without_symbol_table": b"jc_x_function_name\0jc_x_version\0" * 4}
    cases = {}
    for case, data in fakes.items():
        (tmp_path / case).write_bytes(data)
        cases[case] = {"object": str(tmp_path / case), "symbol": "jc_x"}
    for case, message in _instantiate_on_cpu(tmp_path, cases).items():
        assert "kernel test/affine: its object" in message, (case, message)
        assert "is not an ELF object defining function 'jc_x'" in message, (case, message)


def test_instantiate_validates_attributes_on_cpu(tmp_path):
    binary = _compile_affine("test/affine")
    assert binary.obj[:4] == b"\x7fELF" and binary.symbol == "jc_test_affine"
    (tmp_path / "affine.o").write_bytes(binary.obj)
    # Prefixes and suffixes of the real symbol must not pass: the runtime would abort on them.
    wrong = ("jc_test", "test_affine", "jc_test_affine_", "jc_test_affinex", "", "jc_other")
    cases = {
        "good": {},
        "offsets_short": {"arg_offsets": [0, 2, 4, 4]},
        "offsets_decrease": {"arg_offsets": [0, 3, 2, 5]},
        "align_count": {"arg_align": [16, 16]},
        "align_not_pow2": {"arg_align": [3, 16, 0]},
        "unknown_kind": {"arg_kinds": [0, 1, -7]},
        "bad_arch": {"arch_major": 0},
        "wrong_key": {"key": "ab" * 32},
        "stream_words": {"arg_offsets": [0, 2, 4, 6], "arg_words": [0, 8, 0, 8, 0, 0]},
        "names_count": {"arg_names": "x,y"},
        "dtypes_count": {"arg_dtypes": [11, 11]},
        "not_a_buffer": {"arg_ranks": [-1, 1, -1]},
        **{"symbol " + symbol: {"symbol": symbol} for symbol in wrong},
    }
    for over in cases.values():
        over.setdefault("object", str(tmp_path / "affine.o"))
        over.setdefault("symbol", binary.symbol)
    out = _instantiate_on_cpu(tmp_path, cases)
    # A well-formed call passes instantiate and fails only where XLA:CPU has no CUDA stream.
    assert "jax_cute" not in out["good"] and "stream" in out["good"].lower(), out["good"]
    for symbol in wrong:
        assert f"defining function '{symbol}'" in out["symbol " + symbol], out["symbol " + symbol]
    assert "arg_offsets ends at 4" in out["offsets_short"]
    assert "arg_offsets must increase" in out["offsets_decrease"]
    assert "arg_align has 2 entries" in out["align_count"]
    assert "not a power of two" in out["align_not_pow2"]
    assert "unknown kind -7" in out["unknown_kind"]
    assert "not a compute capability" in out["bad_arch"]
    assert f"its key {'ab' * 32} is not the sha256 of its object" in out["wrong_key"]
    assert "argument 2 ('stream'): a stream takes one descriptor word, not 2" in out["stream_words"]
    assert "arg_names names 2 arguments, arg_kinds 3" in out["names_count"]
    assert "arg_dtypes, arg_ranks and arg_bytes have 2, 3 and 3 entries" in out["dtypes_count"]
    assert "argument 0 ('x'): dtype 11, rank -1 or size 32 is not a buffer's" in out["not_a_buffer"]
    for case, message in out.items():
        if case != "good":
            assert "kernel test/affine" in message, (case, message)


def test_the_dsl_runtime_comes_from_the_installed_distribution_only(tmp_path):
    """A folder named like the DSL's package in the working directory (first on sys.path) is
    never where the runtime library is loaded from."""
    fake = tmp_path / "nvidia_cutlass_dsl" / "cu13" / "lib"
    fake.mkdir(parents=True)
    (fake / "libcute_dsl_runtime.so").write_bytes(b"not a library")
    probe = "import nvidia_cutlass_dsl; from jax_cute import runtime; print(runtime.dsl_runtime_library())"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    path = out.stdout.strip().splitlines()[-1]
    assert path == runtime.dsl_runtime_library() and not path.startswith(str(tmp_path))


def test_compiles_see_only_the_program_name(monkeypatch):
    """A user's flags (``--h`` is a prefix of the DSL's ``--help``) never reach the DSL's
    argument parser, and sys.argv is whole again afterwards."""
    monkeypatch.setattr(sys, "argv", ["train.py", "--h", "4096"])
    binary = _compile_affine("test/argv")
    assert binary.obj[:4] == b"\x7fELF" and sys.argv == ["train.py", "--h", "4096"]

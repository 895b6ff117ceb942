"""Print one sha256 of the PTX of each kernel configuration in a representative set: the
project's check that a refactor of jax_cute/kernels leaves the generated code unchanged.

Usage (CPU only, no GPU needed; about 3 s a configuration on a 2-core machine):

    python tools/ptx_digest.py > /tmp/ptx-before.txt      # on the code before the change
    python tools/ptx_digest.py > /tmp/ptx-after.txt       # after it
    diff /tmp/ptx-before.txt /tmp/ptx-after.txt            # no output: byte-identical PTX

    python tools/ptx_digest.py --only sm100                # configurations whose label holds "sm100"
    python tools/ptx_digest.py --list                      # labels only, nothing compiled
    python tools/ptx_digest.py --dump DIR                  # also write each normalised PTX to DIR

Each line is ``<sha256>  <label>``; the label names the family, the spec's key and the config's
key. A configuration that fails to compile prints ``FAILED`` with the error's first line.

Normalisation (the only change made to the PTX before hashing): the identifier of every
``.entry`` and ``.func`` the PTX declares is replaced by ``KERNEL0``, ``KERNEL1``, ... in order
of declaration, everywhere it occurs (its ``_param_<i>`` names included). The DSL derives those
names from the Python module path and qualified name of the kernel method and from its argument
types (``kernel_cutlass_kernel_jax_cutekernelssm90_gemm_..._Sm90Gemm_object_at_...``), so moving
the kernel class to another module renames them without changing any instruction. Everything
else (instructions, registers, parameter sizes and alignment, .version/.target lines) is hashed
as the DSL wrote it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from typing import Iterator

from jax_cute.kernels import sm90_gemm, sm90_grouped, sm100_gemm, sm100_grouped
from jax_cute.kernels.gemm_spec import GemmSpec, GroupedSpec

BF, F16, F32 = "bfloat16", "float16", "float32"
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
ACTIVATIONS = ("relu", "gelu", "gelu_exact", "silu")   # kernels/epilogue.py's on the day this list was made

_DECLARED = re.compile(
    r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)", re.MULTILINE)


def normalise(ptx: str) -> str:
    """``ptx`` with its declared kernel and function names replaced (see the module notes)."""
    names = list(dict.fromkeys(_DECLARED.findall(ptx)))
    for i, name in sorted(enumerate(names), key=lambda p: -len(p[1])):   # longest first: no prefix clashes
        ptx = re.sub(rf"(?<![\w$]){re.escape(name)}(?=_param_\d|[^\w$]|$)", f"KERNEL{i}", ptx)
    return ptx


def _sm90() -> Iterator[tuple[object, object, object]]:
    fam, C = sm90_gemm, sm90_gemm.Config
    pp, pp160, pp128 = sm90_gemm._PINGPONG, sm90_gemm._PINGPONG_160, sm90_gemm._PINGPONG_128
    wide = C(epi_n=64, whole_c=True)        # the heuristic's pick for 16-bit outputs
    dense = [
        (GemmSpec(BF, BF, BF), C()),
        (GemmSpec(BF, BF, BF), wide),
        (GemmSpec(BF, BF, BF), C(epi_n=64)),
        (GemmSpec(F16, F16, F16, "m", "n", "n"), wide),
        (GemmSpec(BF, BF, F32, "k", "n", "m"), C()),
        (GemmSpec(F16, F16, F32, "m", "n", "m"), C(128, 128, 1, 2, split_k=4)),
        (GemmSpec(BF, BF, F16, "k", "n", "n"), C(128, 256, 2, 1, split_k=2, epi_n=64)),
        (GemmSpec(BF, BF, BF, "m", "k", "n"), C(128, 128, 1, 1)),
        (GemmSpec(BF, BF, BF, "m", "n", "m"), C(raster="n", group=16)),
        (GemmSpec(BF, BF, BF), C(128, 128, 2, 2)),
        (GemmSpec(BF, BF, BF), C(pdl=True)),
        (GemmSpec(BF, BF, BF), C(256, 128, 2, 1, epi_n=64)),
        (GemmSpec(BF, BF, BF), pp),
        (GemmSpec(BF, BF, F32, "m", "n", "n"), pp160),
        (GemmSpec(F16, F16, F16), pp128),
        (GemmSpec(BF, BF, BF), C(defer=sm90_gemm.DEFER)),
        (GemmSpec(F16, F16, F16, "m", "n", "m"), C(epi_n=64, defer=1)),
        (GemmSpec(E4M3, E4M3, BF), wide),
        (GemmSpec(E5M2, E5M2, F32), pp128),
        (GemmSpec(E4M3, E4M3, F16), C(128, 256, 1, 2, split_k=2)),
        (GemmSpec(BF, BF, BF, batch_modes=3), wide),
        (GemmSpec(BF, BF, F32, "m", "n", "m", batch_modes=3), C(128, 128, 2, 1, split_k=2)),
        # fused epilogues
        (GemmSpec(BF, BF, BF, bias=True), wide),
        (GemmSpec(BF, BF, F32, bias=True), C(split_k=2)),
        *[(GemmSpec(BF, BF, BF, bias=True, activation=a), wide) for a in ACTIVATIONS],
        *[(GemmSpec(BF, BF, F32, activation=a), C()) for a in ACTIVATIONS],
        (GemmSpec(F16, F16, F16, "m", "n", "n", bias=True, activation="gelu"), pp160),
        (GemmSpec(BF, BF, BF, bias=True, activation="silu", batch_modes=3), wide),
        (GemmSpec(BF, BF, BF, bias=True, activation="swiglu"), wide),
        (GemmSpec(BF, BF, F32, activation="swiglu"), C(128, 128, 2, 1)),
        (GemmSpec(E4M3, E4M3, BF, bias=True, activation="swiglu"), pp128),
        (GemmSpec(BF, BF, BF, bias=True, activation="gelu", preact=True), C(epi_n=64)),
        (GemmSpec(BF, BF, BF, activation="relu", preact=True), wide),
        (GemmSpec(BF, BF, F32, bias=True, activation="silu", preact=True), C()),
        (GemmSpec(BF, BF, BF, bias=True, activation="gelu", preact=True), pp128),
        (GemmSpec(BF, BF, BF, bias=True, activation="swiglu", preact=True), C(epi_n=64)),
        # an activation's derivative in the backward GEMM
        *[(GemmSpec(BF, BF, BF, dact=a), wide) for a in ACTIVATIONS],
        (GemmSpec(BF, BF, F32, "m", "n", "m", dact="gelu"), C()),
        (GemmSpec(F16, F16, F16, dact="silu"), pp128),
    ]
    for spec, cfg in dense:
        yield fam, spec, cfg
    grouped = [
        (GroupedSpec("ragged_m", BF, BF, BF), sm90_grouped.Config(256)),
        (GroupedSpec("ragged_m", F16, F16, F16, b_major="n"), sm90_grouped.Config(128)),
        (GroupedSpec("ragged_m", BF, BF, F32), sm90_grouped.Config(256)),
        (GroupedSpec("ragged_k", BF, BF, BF, a_major="m", b_major="n"), sm90_grouped.Config(256)),
        (GroupedSpec("ragged_k", BF, BF, F32, a_major="m", b_major="n", c_major="m"), sm90_grouped.Config(128)),
        # fused grouped (ragged_m)
        (GroupedSpec("ragged_m", BF, BF, BF, bias=True, activation="gelu"), sm90_grouped.Config(256)),
        (GroupedSpec("ragged_m", BF, BF, BF, activation="silu", preact=True), sm90_grouped.Config(256)),
        (GroupedSpec("ragged_m", BF, BF, BF, b_major="n", bias=True, activation="swiglu", preact=True),
         sm90_grouped.Config(256)),
        (GroupedSpec("ragged_m", BF, BF, F32, bias=True, activation="relu"), sm90_grouped.Config(128)),
        # block-scaled fp8 ragged_k (the grouped weight gradient)
        (GroupedSpec("ragged_k", E4M3, E4M3, F32, a_block=1, b_block=1), sm90_grouped.Config(128)),
    ]
    for spec, cfg in grouped:
        yield sm90_grouped, spec, cfg


def _sm100() -> Iterator[tuple[object, object, object]]:
    specs = [GemmSpec(BF, BF, BF), GemmSpec(F16, F16, F32, "m", "n", "m"), GemmSpec(BF, BF, F16, "k", "n", "n")]
    for i, cfg in enumerate(sm100_gemm.candidate_configs(specs[0])):
        yield sm100_gemm, specs[i % len(specs)], cfg
    yield sm100_gemm, GemmSpec(BF, BF, BF, batch_modes=3), sm100_gemm.Config(128, 128)
    yield sm100_gemm, GemmSpec(F16, F16, F32, "m", "n", "m", batch_modes=3), \
        sm100_gemm.Config(256, 256, cluster_m=2, two_cta=True)
    # fused epilogues
    cands = sm100_gemm.candidate_configs(specs[0])
    yield sm100_gemm, GemmSpec(BF, BF, BF, bias=True, activation="gelu"), cands[2]
    yield sm100_gemm, GemmSpec(F16, F16, F32, "m", "n", "m", activation="relu", preact=True), cands[3]
    yield sm100_gemm, GemmSpec(BF, BF, BF, bias=True, activation="silu", preact=True, batch_modes=3), cands[0]
    yield sm100_gemm, GemmSpec(BF, BF, BF, dact="gelu"), cands[4]
    for mode, majors in (("ragged_m", ("k", "k", "n")), ("ragged_k", ("m", "n", "n"))):
        spec = GroupedSpec(mode, BF, BF, BF, *majors)
        for cfg in sm100_grouped.candidate_configs(spec):
            yield sm100_grouped, spec, cfg
    fused = GroupedSpec("ragged_m", BF, BF, BF, bias=True, activation="gelu", preact=True)
    yield sm100_grouped, fused, sm100_grouped.candidate_configs(fused)[2]


def configurations() -> list[tuple[str, object, object, object]]:
    out = []
    for fam, spec, cfg in [*_sm90(), *_sm100()]:
        out.append((f"{fam.FAMILY}:{spec.key()}:{cfg.key()}", fam, spec, cfg))
    labels = [o[0] for o in out]
    assert len(set(labels)) == len(labels), "duplicate configurations"
    return out


def digest(fam, spec, cfg) -> tuple[str, str]:
    from jax_cute.kernels import build   # compiling imports the DSL

    binary = build.compile_launcher(fam.launcher(spec, cfg), fam.signature(spec, cfg), arch=fam.ARCH,
                                    name="ptx_digest", keep_ptx=True)
    if not binary.ptx:
        raise RuntimeError("the DSL kept no PTX")
    text = normalise(binary.ptx)
    return hashlib.sha256(text.encode()).hexdigest(), text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="compile only configurations whose label contains this")
    parser.add_argument("--list", action="store_true", help="print the labels and exit")
    parser.add_argument("--dump", default="", help="directory to write each normalised PTX to")
    args = parser.parse_args(argv)
    sys.argv[1:] = []   # the DSL parses sys.argv on every compile
    failed = 0
    for label, fam, spec, cfg in configurations():
        if args.only not in label:
            continue
        if args.list:
            print(label)
            continue
        try:
            h, text = digest(fam, spec, cfg)
        except Exception as e:   # report every configuration, then fail
            failed += 1
            print(f"{'FAILED':64}  {label}  {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}",
                  flush=True)
            continue
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, re.sub(r"[^\w.-]", "_", label) + ".ptx"), "w") as f:
                f.write(text)
        print(f"{h}  {label}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

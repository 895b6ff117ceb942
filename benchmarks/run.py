"""Run benchmark suites on a GPU and write JSON; or turn result files into BENCHMARKS.md and plots.

    python benchmarks/run.py --suite matmul,ragged,launch --out benchmarks/results/h200-matmul.json
    python benchmarks/bench_first_call.py --cache DIR [--cold] --out benchmarks/results/h200-first-call.jsonl
    python benchmarks/run.py --report benchmarks/results/*
    python benchmarks/run.py --suite ragged --cases '^MoE layer' --out moe.json
    python benchmarks/run.py --merge benchmarks/results/h200-ragged.json moe.json "the MoE layer"

The last two re-measure some cases of a table; the report then dates those rows apart.
Each suite runs in its own process (fresh GPU memory; the launch suite needs its own XLA_FLAGS).
The report reads only the result files: it runs on any machine and prints only what was measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUITES = {"models": "bench_models.py", "matmul": "bench_matmul.py", "layouts": "bench_layouts.py", "ragged": "bench_ragged.py",
          "launch": "bench_launch.py", "fused": "bench_fused.py", "scaling": "bench_scaling.py",
          "collective": "bench_collective.py", "fp8": "bench_fp8.py", "scan": "bench_scan.py"}
IMPL_ORDER = ["jax_cute", "xla", "pallas"]
IMPL_LABEL = {"jax_cute": "jax_cute", "xla": "XLA", "pallas": "Pallas", "xla_bf16_grads": "XLA, bf16 gradient GEMMs",
              "jax_cute_kernelize": "kernelize(jnp step): gelu fused"}
# The collective suite's rows (benchmarks/bench_collective.py)
IMPL_LABEL.update({"jax_cute_unidirectional": "jax_cute, one-way ring", "jax_cute_no_ring": "jax_cute, XLA collective",
                   "xla_windowed": "XLA windowed einsum", "local_gemm": "local GEMM (no communication)",
                   "jax_cute_sms0": "jax_cute, ring GEMMs on every SM",
                   "jax_cute_stream": "jax_cute, launched outside CUDA graphs"})
IMPL_LABEL["jax_cute_new_buffer"] = "jax_cute, new output buffer"  # the launch suite


# -- running ----------------------------------------------------------------------------------

def _commit() -> str:
    if os.environ.get("JAX_CUTE_COMMIT"):
        return os.environ["JAX_CUTE_COMMIT"]
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # read-only: never touch the index
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True, env=env).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, env=env).returncode != 0
    return head + ("+uncommitted-changes" if dirty else "")


def run_suites(suites: list[str], out: str, extra: list[str], time_limit: float | None = None,
               cases: str | None = None) -> dict:
    # No jax backend in this process: it would take the GPU memory the suites need.
    start = time.monotonic()
    result = {"device": None, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": _commit(), "suites": suites, "records": [], "suite_errors": {}}
    if cases:
        result["cases"] = cases   # only the cases whose labels this matches were measured
    try:
        from importlib.metadata import version
        result["cutlass_dsl_version"] = version("nvidia-cutlass-dsl-libs-base")
    except Exception:  # noqa: BLE001 - the GPU machine may carry only the DSL's runtime
        pass
    for suite in suites:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            path = tmp.name
        print(f"== suite {suite}", flush=True)
        proc = subprocess.Popen([sys.executable, str(HERE / SUITES[suite]), "--records", path, *extra])
        stopped = False
        try:
            proc.wait(None if time_limit is None else max(time_limit - (time.monotonic() - start), 1))
        except subprocess.TimeoutExpired:
            # the suite writes the cases it finished on SIGTERM (common.suite_main)
            stopped = True
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if stopped:
            result["suite_errors"][suite] = f"stopped at the time limit ({time_limit:.0f} s); later cases did not run"
        try:
            got = json.loads(Path(path).read_text())
            result["records"] += got["records"]
            for k in ("device", "backend", "device_count", "jax_version"):
                result[k] = result.get(k) or got.get(k)
        except (OSError, ValueError, KeyError) as e:
            result["suite_errors"][suite] = f"exit {proc.returncode}: no records ({e})"
        finally:
            Path(path).unlink(missing_ok=True)
        if proc.returncode:
            result["suite_errors"].setdefault(suite, f"exit {proc.returncode}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}: {len(result['records'])} records from {result['device']}")
    return result


# -- report -----------------------------------------------------------------------------------

def _fmt(v: float | None, digits: int = 1) -> str:
    if v is None:
        return "—"
    if abs(v) >= 10:
        return f"{v:.{digits}f}"
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"  # small values keep 3 significant digits


def _label(impl: str, labels: dict[str, str] | None = None) -> str:
    return (labels or {}).get(impl) or IMPL_LABEL.get(impl, impl)


def _suite_labels(suites: list[str]) -> dict[str, str] | None:
    """The implementation labels of a results file's suite (none for a file of several suites)."""
    return SUITE_LABELS.get(suites[0]) if len(suites) == 1 else None


def _impls(recs: list[dict]) -> list[str]:
    seen = {r["impl"] for r in recs}
    return [i for i in IMPL_ORDER if i in seen] + sorted(seen - set(IMPL_ORDER))


def _by_case(recs: list[dict]) -> dict[str, dict[str, dict]]:
    cases: dict[str, dict[str, dict]] = {}
    for r in recs:
        cases.setdefault(r["case"], {})[r["impl"]] = r
    return cases


def _cell(r: dict | None, key: str, digits: int) -> str:
    if r is None:
        return "—"
    if r.get("error"):
        return "failed"
    text = _fmt(r.get(key), digits)
    if r.get("impl") == "jax_cute" and r.get("kernel") is False:
        text += " (XLA fallback)"  # it ran, but not on our kernel: never present it as ours
    return text


def table(recs: list[dict], key: str, unit: str, higher_better: bool, digits: int = 1,
          labels: dict[str, str] | None = None) -> list[str]:
    """Markdown rows: one per case, a column per implementation, then jax_cute vs each rival."""
    impls = _impls(recs)
    rivals = [i for i in impls if i != "jax_cute"] if "jax_cute" in impls else []
    head = ["case"] + [f"{_label(i, labels)} ({unit})" for i in impls] + \
           [f"jax_cute vs {_label(i, labels)}" for i in rivals]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, by in _by_case(recs).items():
        row = [case] + [_cell(by.get(i), key, digits) for i in impls]
        ours = by.get("jax_cute")
        for i in rivals:
            a, b = (ours or {}).get(key), (by.get(i) or {}).get(key)
            ok = ours and not ours.get("error") and ours.get("kernel") is not False and b and not by[i].get("error")
            # Ratio > 1 always means jax_cute is better (more TFLOP/s, or less time).
            row.append(f"{(a / b if higher_better else b / a):.2f}×" if ok and a else "—")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def plot(recs: list[dict], key: str, ylabel: str, title: str, path: Path,
         labels: dict[str, str] | None = None) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'jax-cute[bench]'): tables only, no plots")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _by_case(recs)
    impls = _impls(recs)
    if not cases:
        return False
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cases) + 2), 4.5))
    for j, impl in enumerate(impls):
        xs, ys = [], []
        for i, by in enumerate(cases.values()):
            r = by.get(impl)
            if r and not r.get("error") and r.get(key) is not None:  # plot only what was measured
                xs.append(i + (j - (len(impls) - 1) / 2) * width)
                ys.append(r[key])
        ax.bar(xs, ys, width, label=_label(impl, labels))
    ax.set_xticks(range(len(cases)), list(cases), rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)   # (the repo rides along on every GPU run, next to the 64 MiB DSL bundle)
    plt.close(fig)
    return True


SECTIONS = [  # (table, record key, unit, higher is better, title, digits)
    ("gemm", "tflops", "TFLOP/s", True, "GEMM (M×N×K; bf16 unless marked fp8)", 1),
    ("gemm_loop", "tflops", "TFLOP/s", True, "Small GEMMs: 64 dependent products in one lax.fori_loop (no host dispatch; the loop's own per-iteration overhead included)", 1),
    ("gemm_sustained", "tflops", "TFLOP/s", True, "Large GEMMs under sustained load: 1 s windows, bf16", 1),
    ("ragged", "tflops", "TFLOP/s", True, "Grouped GEMM (ragged_dot), bf16: forward, lhs and rhs gradients", 1),
    ("fp8_gemm", "tflops", "TFLOP/s", True, "Block-scaled fp8 GEMM (M×N×K, 1×128 / 128×128 scales, bf16 out)", 1),
    ("fp8_grouped", "tflops", "TFLOP/s", True, "Block-scaled fp8 grouped GEMM, contiguous groups (G×rows×N×K)", 1),
    ("fp8_wgrad", "tflops", "TFLOP/s", True, "Block-scaled fp8 weight gradient (M×N×tokens, 1×128 scales along the tokens, bf16 out)", 1),
    ("fp8_wgrad_grouped", "tflops", "TFLOP/s", True, "Block-scaled fp8 weight gradient, ragged-K (G×M×N×tokens)", 1),
    ("fp8_swiglu", "tflops", "TFLOP/s", True,
     "Block-scaled fp8 SwiGLU gate-and-up product with a bias (M×N×K; grouped G×rows×N×K), bf16 out", 1),
    ("fp8_train", "ms", "ms", False, "GPT training step, weight products in block-scaled fp8 (time per step)", 2),
    ("e2e", "ms", "ms", False, "End-to-end steps (time per call)", 2),
    ("scan", "ms", "ms", False, "A layer stack's value and gradient (time per call)", 2),
    ("launch", "us_per_iter", "µs/iter", False, "Tiny kernel in a fori_loop (command buffers off)", 2),
    ("scaling", "tokens_per_s_per_device", "tokens/s per GPU", True, "Training step on several GPUs, same batch per GPU", 0),
    ("collective", "ms", "ms", False, "Tensor-parallel products with their collective, all visible GPUs", 3),
    ("collective_windowed", "ms", "ms", False, "The same, in a process with XLA's windowed einsum on", 3),
    ("collective_lhs", "ms", "ms", False, "The same, in a process with XLA's latency-hiding scheduler on", 3),
    ("collective_memcpy_p2p", "ms", "ms", False,
     "The same, in a process with collective-permutes as peer copies (--xla_gpu_use_memcpy_local_p2p)", 3),
    ("collective_lhs_memcpy_p2p", "ms", "ms", False, "The same, with both", 3),
    ("collective_lhs_overlap2", "ms", "ms", False,
     "The same, the latency-hiding scheduler with two collectives in flight", 3),
    ("collective_lhs_windowed", "ms", "ms", False, "XLA's windowed einsum with the latency-hiding scheduler on", 3),
]
SUITE_TITLE = {"models": "Models: jax_cute.kernelize", "matmul": "Dense GEMM: jax_cute.matmul", "layouts": "Layouts: einsum, LM head, vmap of batched",
               "ragged": "Grouped GEMM: jax_cute.ragged_dot",
               "launch": "Launch overhead", "fused": "Fused epilogues: bias and activation",
               "scaling": "Several GPUs: the GPT training step sharded",
               "collective": "Collective matmul: all-gather and reduce-scatter inside the GEMMs",
               "fp8": "Block-scaled fp8 GEMM: DeepGEMM's shapes",
               "scan": "Layer stacks under lax.scan: checkpoint policies"}
# A results file holding only these tables (e.g. BENCH_FP8_GEMM=0) gets this title and note.
TABLE_SECTION = {"fp8_swiglu": ("Block-scaled fp8 SwiGLU products",
                                "The gate-and-up product of a SwiGLU MLP with a bias (N = 2 x the hidden width), "
                                "operands quantized beforehand (x in 1x128, w in 128x128 blocks), timed interleaved: "
                                "*jax_cute fp8*: `matmul` / `ragged_dot(..., bias=, activation=\"swiglu\")` of the "
                                "block-scaled operands, the SwiGLU in the kernel's epilogue (B's scales read per 64 "
                                "paired columns, the overlapped promotion); *serial promotion*: the same kernel with "
                                "the serial promotion forced; *fp8 gelu*: the same fp8 operands with gelu (no "
                                "gate-and-up pairing); *jax_cute bf16*: our bf16 SwiGLU product of the same values; "
                                "*XLA bf16*: the layer as written in bf16 (dot, bias, `silu(gate) * up`); *XLA fp8 "
                                "dot*: XLA's dot of the raw e4m3 values (no block scales), the bias and SwiGLU in XLA."),
                 "fp8_train": ("Block-scaled fp8 training steps: the GPT example",
                               "The GPT example's step (`examples/gpt_training.py` at its `h200` and `h200-wide` sizes (d_model 2048 and 4096), dense and "
                               "`--moe`), timed interleaved: *jax_cute fp8*: `value_and_grad(kernelize(loss, "
                               "fp8=\"blockwise\"))`, the weight products' forward and both gradients block-scaled "
                               "fp8, quantization included; *jax_cute bf16*: the same kernelized in bf16; *XLA*: the "
                               "model as written (bf16 products).")}
TABLE_SECTION["fp8_wgrad"] = TABLE_SECTION["fp8_wgrad_grouped"] = (
    "Block-scaled fp8 weight gradients",
    "`dw = x.T @ dy` with both operands in 1x128 blocks along the tokens (each 128-token k-tile's partial "
    "sums promoted with x's row scales and dy's column scales), dense (M×N×tokens) and ragged-K (G experts "
    "over the tokens, `ragged_k_dot`), operands quantized beforehand, bf16 out, timed interleaved: "
    "*jax_cute fp8*: the heuristic's kernel (the serial promotion); *overlapped promotion*: the same with "
    "the overlapped promotion forced (the column scales read from shared memory at the promotion); "
    "*jax_cute bf16*: the same values in bf16; *XLA fp8 dot*: XLA's dot of the raw e4m3 values (no block "
    "scales; dense only); *jax_cute fp8 (no block scales)*: our unscaled fp8 kernel on the same raw values "
    "(XLA's numerics, the like-for-like rival of XLA's row and the ceiling the promotion is measured against).")


def own_section(tables) -> tuple[str, str] | None:
    """The (title, note) of a results file whose tables all tell one TABLE_SECTION story, or None."""
    sections = {TABLE_SECTION.get(t) for t in tables}
    return next(iter(sections)) if len(sections) == 1 else None
SUITE_LABELS = {"ragged": {"xla": "lax.ragged_dot",   # what the "xla" rival is in that suite
                           "jax_cute_no_tail": "jax_cute, no tail split"},
                "fp8": {"jax_cute": "jax_cute fp8, block-scaled", "jax_cute_bf16": "jax_cute bf16",
                        "jax_cute_db": "fp8, overlapped promotion", "jax_cute_serial": "fp8, serial promotion",
                        "jax_cute_db_c2x2": "fp8, overlapped, 2x2 clusters", "jax_cute_256x128": "fp8, 256x128 tile",
                        "jax_cute_1cta": "fp8, one CTA (no cluster)", "jax_cute_gelu": "fp8 gelu, same operands",
                        "jax_cute_raw": "jax_cute fp8 (no block scales)",
                        "xla": "XLA fp8 dot (no block scales)", "xla_bf16": "XLA bf16, as written"},
                "models": {"jax_cute_unfused": "jax_cute, gelu not fused"},
                "scan": {"jax_cute": "jax_cute.kernelize", "xla": "XLA, as written", "xla_bf16": "XLA, bf16 products"},
                "scaling": {"jax_cute_float32_sums": "jax_cute, float32 sums over GPUs"},
                "fused": {"jax_cute": "jax_cute fused", "jax_cute_remat": "jax_cute fused, jax.checkpoint",
                          "jax_cute_unfused": "jax_cute + jnp epilogue",
                          "jax_cute_kernelize": "kernelize(XLA layer)"}}
SUITE_NOTE = {
    "fp8": "*jax_cute fp8*: `jax_cute.matmul` (`ragged_dot` grouped) of operands quantized beforehand, x in "
           "1x128 and w in 128x128 blocks, bf16 out, with the heuristic's configuration (the overlapped "
           "promotion on 2x1 clusters, grouped on 1x2 clusters); the *overlapped*, *serial promotion* (where measured) and "
           "*2x2 clusters* rows force the block-scaled mainloop's variants on the heuristic's tile, so the overlapped row runs the "
           "heuristic's own kernel: its distance from the first column is the run's variation; *256x128 tile*: "
           "the 256 x 128 tile on 2x1 clusters, forced (never the heuristic's pick); *one CTA*: the grouped "
           "pick without its cluster (A not multicast). "
           "*jax_cute bf16*: the same values in bf16. *XLA fp8 dot*: `lax.dot_general` of the raw e4m3 values, "
           "no block scales (cuBLAS, fast accumulation); *jax_cute fp8 (no block scales)*: `jax_cute.matmul` of "
           "the same raw values (the same numerics as XLA's row, our unscaled fp8 kernel). Training step: `examples/gpt_training.py`'s step at its "
           "`h200` and `h200-wide` sizes, *jax_cute fp8* `value_and_grad(kernelize(loss, fp8=fp8_recipe(cfg)))` (the weight "
           "products' forward, dgrad and wgrad block-scaled fp8, their quantization included), *jax_cute bf16* "
           "the same kernelized in bf16, *XLA* the model as written, timed interleaved in one process.",
    "collective": "*jax_cute*: `JAX_CUTE_COLLECTIVE_MATMUL=1`, the partitioning rules' bidirectional ring of "
                  "collective permutes and per-chunk jax_cute GEMMs, which leave `JAX_CUTE_RING_SMS` SMs (default 16) "
                  "free for the transfers ([docs/sharding.md](docs/sharding.md)); *ring GEMMs on every SM*: the same "
                  "with `JAX_CUTE_RING_SMS=0` (jax_cute_sms<R>: R SMs left free); *one-way ring*: `=unidirectional`; *XLA collective*: the switch off (XLA's all-gather or reduce-scatter "
                  "around our GEMM); XLA: `jnp.dot` with the same shardings; Pallas: the fastest of four configs of "
                  "Pallas' Mosaic GPU `all_gather_lhs_matmul`; *local GEMM*: each device's products on inputs already "
                  "in place, no communication (the floor). Per-device TFLOP/s aside, times are per call, all devices "
                  "in one process. XLA's windowed einsum needs process-wide flags: its table comes from a second "
                  "process, timed interleaved with jax_cute and the local GEMM there; the other tables (XLA's "
                  "latency-hiding scheduler, peer-copy collective-permutes) from a process each, when run.",
    "matmul": "XLA: `jnp.matmul` (cuBLAS, or XLA's Triton GEMM where XLA picks it). Pallas: the fastest of four "
              "configs of Pallas' Mosaic GPU Hopper matmul. Each call runs 8 independent products in one jit. "
              "The MLP step is the forward + backward + SGD update of `examples/mlp_training.py`; *XLA, bf16 "
              "gradient GEMMs* rounds the f32 cotangent to bf16 as jax_cute does, the like-for-like baseline. "
              "The step is timed in 250 ms windows (the board at its power cap), 11 rounds.",
    "scan": "A stack of MLP layers (`x + gelu(x @ w1) @ w2`, bf16 weights and activations) under `lax.scan`, "
            "each layer under `jax.checkpoint` with the policy the row names (or none; `prevent_cse=False` where "
            "the row says so, as JAX documents it safe in a scan), the value and gradient "
            "of a loss of its output; TFLOP/s count the six products of each layer's forward and backward, "
            "not recomputations. *jax_cute.kernelize*: the layer kernelized (gelu in the first GEMM's epilogue, "
            "its derivative in the backward GEMM of the second); the policies see our GEMMs as the dots they "
            "replace. *XLA, as written*: the products with float32 outputs, so the gradient GEMMs take "
            "float32 cotangents; *XLA, bf16 products*: bf16 outputs, so bf16 gradient GEMMs as ours (the "
            "like-for-like baseline; its gelu reads the product rounded to bf16, ours the float32 "
            "accumulator). Timed interleaved in one process, 250 ms windows.",
    "models": "The training step of `examples/gpt_training.py` (embeddings, pre-norm blocks of causal attention "
              "through `jnp.einsum` and a GELU MLP or a top-2 mixture of experts on `lax.ragged_dot`, layers "
              "under `lax.scan` + `jax.checkpoint`, tied LM head, AdamW; bf16 products, f32 master weights): "
              "*jax_cute* is `jax.value_and_grad(jax_cute.kernelize(loss))` (the dense MLP's gelu in its first "
              "GEMM's epilogue, its derivative in the backward GEMM of the second; the experts' gelu in the grouped "
              "kernel's epilogue), *XLA* the model as written (its gradient products take the f32 cotangents), "
              "*XLA, bf16 gradient GEMMs* the same with each product's cotangent rounded to bf16 as jax_cute "
              "does (the like-for-like baseline); *gelu not fused*: "
              "`kernelize(loss, fuse_epilogues=False)`, the gelu and its derivative XLA passes.",
    "layouts": "XLA: the same `jnp.einsum` / `jnp.matmul` expression. Attention products read (B, T, H, D) "
               "activations and write their outputs in the einsum's order; the LM head has a 50257-word "
               "vocabulary (rows of 100514 bytes: the forward's logits are stored without TMA where they lie, the "
               "gradients read the cotangent padded to 16-byte rows); *vmap of batched* maps axis 1 of a "
               "product batched along axis 0 (two batch modes), *flat batched* is the same product with one.",
    "ragged": "lax.ragged_dot: `jax.lax.ragged_dot` compiled by XLA. Pallas: the fastest of up to four configs of "
              "Pallas' `ragged_dot_mgpu` (forward, lhs gradient) or `transposed_ragged_dot_mgpu` (rhs gradient). "
              "Group sizes are uniform or drawn from Dirichlet(0.3) (a few large groups, many small or empty "
              "ones). *jax_cute, no tail split*: the forward and lhs gradient with the grouped walk's tail split off "
              "(the last, partial round of tiles split along K; docs/performance.md). The MoE layer is "
              "`examples/moe_training.py`'s (router, top-2 of 8 experts, two grouped GEMMs).",
    "scaling": "The training step of `examples/gpt_training.py` at its `h200` size on a mesh of 1, 2, "
               "4, ... GPUs of one host, up to all it has (`--mesh data=N`), 16 sequences of 1024 tokens "
               "per GPU: the dense model data parallel (the batch split, gradients summed), the MoE model expert parallel (its layer a `shard_map` "
               "with all-to-all token dispatch, 8 experts split over the GPUs; AdamW's moments "
               "sharded as the weights). *jax_cute*: "
               "`value_and_grad(kernelize(loss))`, its weight gradients summed over GPUs in bf16 (the default); "
               "*float32 sums over GPUs*: the same with `JAX_CUTE_FLOAT32_PARTIAL_SUMS=1` (where measured); "
               "*XLA*: the same model and shardings as written. *Scaling*: "
               "tokens/s per GPU against the same implementation on one GPU.",
    "launch": "A tiny `cute_call` kernel (`examples/custom_kernel.py`'s `a * alpha + b`) against the same `jnp` "
              "expression, 1000 dependent iterations in one `lax.fori_loop`, with XLA's command buffers off so "
              "that every iteration is a real launch. Both update the loop carry in place (the kernel through "
              "`cute_call(..., input_output_aliases={0: 0})`); *new output buffer*: the kernel writes a fresh "
              "buffer, which XLA copies into the carry each iteration.",
    "fused": "*jax_cute fused*: `matmul(..., bias=, activation=)` / `ragged_dot(..., activation=\"swiglu\")`; "
             "*jax_cute + jnp epilogue*: the same GEMMs without the options, the bias and activation in `jnp`; XLA: "
             "the layer in `jnp`. Forward: the kernel's epilogue adds the bias and applies GELU where the Hopper "
             "family fuses them (`sm90_gemm.EPILOGUES`; else the XLA epilogue, logged at INFO), on the "
             "cooperative 128×256 tile, which runs fastest at the power cap ([docs/performance.md](docs/performance.md)). "
             "Forward + backward: the forward kernel writes the output and the pre-activation residual; "
             "the backward multiplies the cotangent by the activation's derivative in XLA (one elementwise pass) "
             "before the two gradient GEMMs; "
             "*jax.checkpoint* recomputes the pre-activation in the backward instead. SwiGLU: each tile loads the "
             "gate columns with the up columns they pair with, in `matmul` and in `ragged_dot`'s grouped kernel. "
             "*kernelize(XLA layer)*: the XLA layer as written, through `jax_cute.kernelize`, which finds its first "
             "bias and gelu and fuses them as *jax_cute fused* does (the second bias stays an XLA pass), and chains "
             "the second product to them: under `grad` the backward GEMM `dout @ w2ᵀ` applies gelu's derivative in "
             "its epilogue, where *jax_cute fused* leaves it to one XLA pass.",
}


def _provenance(data: dict, path: str) -> str:
    """One line: device, date, software, and the file the numbers come from."""
    sw = [f"jax {data['jax_version']}" if data.get("jax_version") else None,
          f"nvidia-cutlass-dsl {data['cutlass_dsl_version']}" if data.get("cutlass_dsl_version") else None]
    # (the result file keeps the commit; the reader's page names the device, date and software)
    later = "".join(f", {m['label']} on {str(m['date'])[:10]}" for m in data.get("merged", []))
    return (f"Measured on {data.get('device', '?')}, {str(data.get('date', '?'))[:10]}{later} "
            f"({', '.join(s for s in sw if s)}); from `{Path(path).name}`.")


def merge(into: str, new: str, label: str) -> dict:
    """Replace the records of `into` whose cases `new` measured (a run with --cases) by `new`'s,
    and record when (`merged`: label, date, commit), so the report dates those rows apart."""
    old, add = json.loads(Path(into).read_text()), json.loads(Path(new).read_text())
    if (old.get("device"), old.get("jax_version")) != (add.get("device"), add.get("jax_version")):
        raise SystemExit(f"{new} ran on {add.get('device')} with jax {add.get('jax_version')}, "
                         f"{into} on {old.get('device')} with jax {old.get('jax_version')}: not one table")
    cases = {r["case"] for r in add["records"]}
    old["records"] = [r for r in old["records"] if r["case"] not in cases] + add["records"]
    old["merged"] = [m for m in old.get("merged", []) if m["label"] != label] + [
        {"label": label, "date": add.get("date"), "commit": add.get("commit"), "cases": sorted(cases)}]
    Path(into).write_text(json.dumps(old, indent=1) + "\n")
    return old


def first_call_section(path: str) -> list[str]:
    """Markdown for bench_first_call.py records: one fresh process per row."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        return []
    devices = sorted({str(r.get("device", "?")) for r in rows})
    dates = sorted({str(r.get("date", "?"))[:10] for r in rows})
    out = ["## First call in a fresh process", "",
           f"Measured on {', '.join(devices)}, {', '.join(dates)}; from `{Path(path).name}`. Phases of the "
           "first call of jax_cute.matmul and of jnp.matmul (XLA) in the same process. *warm*: the kernel "
           "comes from the disk cache; *cold*: empty cache, the DSL compiles it during lowering.", "",
           "| mode | shape | DSL compiler imported | jax_cute lower / compile / first run (ms) | "
           "XLA lower / compile / first run (ms) | jax_cute lowering cost (ms) |", "|---|---|---|---|---|---|"]
    for r in rows:
        ours, xla = r["jax_cute"], r["xla"]
        ms = lambda d: " / ".join(f"{d[k] * 1e3:.0f}" for k in ("lower_s", "compile_s", "first_run_s"))  # noqa: E731
        out.append(f"| {r.get('mode', '?')} | {r['shape']} | {r['cutlass_imported']} | {ms(ours)} | {ms(xla)} | "
                   f"{(ours['lower_s'] + ours['first_run_s']) * 1e3:.0f} |")
    return out + ["", "The lowering cost is our lowering (cache load or compile) plus the first run, where the "
                  "handler loads the module onto the device; XLA's own compile of the module follows either way.", ""]


def traffic_table(recs: list[dict], labels: dict | None) -> list[str]:
    """Markdown: the bytes each implementation's forward epilogues and elementwise passes write
    between the GEMMs (records' ``epilogue_bytes``, computed from the shapes), per case, in MiB."""
    cases: dict[str, dict] = {}
    for r in recs:
        if r.get("epilogue_bytes") and r["case"] not in cases:
            cases[r["case"]] = r["epilogue_bytes"]
    if not cases:
        return []
    impls = list(dict.fromkeys(i for b in cases.values() for i in b))
    out = ["### Bytes the forward writes between its GEMMs (MiB, from the shapes)", "",
           "| case | " + " | ".join(_label(i, labels) for i in impls) + " |", "|---|" + "---|" * len(impls)]
    for case, b in cases.items():
        out.append(f"| {case} | " + " | ".join(f"{b[i] / 2**20:.0f}" if i in b else "—" for i in impls) + " |")
    return out + [""]


ONE_GPU_AS = {"jax_cute_float32_sums": "jax_cute"}   # rows with no one-GPU run of their own (no sums there)


def scaling_table(recs: list[dict], labels: dict[str, str] | None = None) -> list[str]:
    """Markdown: each implementation's tokens/s per GPU as a fraction of its own on one GPU."""
    base = {(r["impl"], r["moe"]): r["tokens_per_s_per_device"] for r in recs
            if r.get("table") == "scaling" and r.get("devices") == 1 and r.get("tokens_per_s_per_device")}
    rows = [r for r in recs if r.get("table") == "scaling" and r.get("devices", 1) > 1]
    impls = _impls(rows)
    if not rows or not base:
        return []
    out = ["### Scaling: tokens/s per GPU against one GPU", "",
           "| case | " + " | ".join(_label(i, labels) for i in impls) + " |", "|---|" + "---|" * len(impls)]
    for case, by in _by_case(rows).items():
        cells = []
        for i in impls:
            r, b = by.get(i), base.get((ONE_GPU_AS.get(i, i), (by.get(i) or {}).get("moe")))
            ok = r and r.get("tokens_per_s_per_device") and b
            cells.append(f"{r['tokens_per_s_per_device'] / b:.3f}" if ok else "—")
        out.append(f"| {case} | " + " | ".join(cells) + " |")
    return out + [""]


# the rivals the README's summary names
SUMMARY_RIVALS = ("xla", "xla_bf16", "xla_bf16_grads", "pallas", "jax_cute_bf16")
SUMMARY_TABLE = {"gemm": "single products", "gemm_loop": "small products in a loop",
                 "gemm_sustained": "1 s windows", "e2e": "MLP training step", "ragged": "single products",
                 "fp8_gemm": "dense", "fp8_grouped": "grouped", "fp8_wgrad": "dense", "fp8_wgrad_grouped": "ragged-K", "scan": "scanned layer stack", ("ragged", "e2e"): "MoE layer"}   # (suite, table): where a suite names a table its own way
# other processes' tables, beside the suite's own (bench_collective.py's flag sets)
SUMMARY_SKIP = ("collective_windowed", "collective_lhs", "collective_memcpy_p2p", "collective_lhs_memcpy_p2p",
                "collective_lhs_overlap2", "collective_lhs_windowed")
SUMMARY_OURS = {"collective": "the rings (`JAX_CUTE_COLLECTIVE_MATMUL=1`, off by default)"}
README_START, README_END = "<!-- results:summary -->", "<!-- /results:summary -->"


def _ratios(recs: list[dict], key: str, higher_better: bool, rival: str) -> list[float]:
    """jax_cute against ``rival`` per case (> 1: jax_cute better), where both ran and jax_cute
    ran its kernel."""
    out = []
    for by in _by_case(recs).values():
        ours, other = by.get("jax_cute"), by.get(rival)
        if not ours or not other or ours.get("error") or other.get("error") or ours.get("kernel") is False:
            continue
        a, b = ours.get(key), other.get(key)
        if a and b:
            out.append(a / b if higher_better else b / a)
    return out


def summary(files: list[str]) -> list[str]:
    """Markdown bullets, one per table of each result file: jax_cute against each rival as the
    geometric mean over the table's cases and their range, with the device and date; the
    scaling table as tokens/s per GPU on the most GPUs against one. The README quotes these
    lines, so its figures are BENCHMARKS.md's."""
    out = []
    for f in files:
        if not f.endswith(".json"):
            continue
        data = json.loads(Path(f).read_text())
        recs = data.get("records", [])
        count = data.get("device_count") or 1
        device = f"{f'{count} x ' if count > 1 else ''}{data.get('device', '?')}"
        suites = data.get("suites") or []
        labels = _suite_labels(suites)
        tables = [t for t in SECTIONS if any(r.get("table") == t[0] for r in recs)]
        tables = [t for t in tables if t[0] not in SUMMARY_SKIP]
        title = " + ".join(SUITE_TITLE.get(su, su).split(":")[0] for su in suites) or Path(f).stem
        own = own_section([t[0] for t in tables])
        if own:   # a file of tables with their own story
            title = own[0].split(":")[0]
        ours = next((SUMMARY_OURS[su] for su in suites if su in SUMMARY_OURS), "jax_cute")
        for tbl, key, _, hb, sub, _ in tables:
            rs = [r for r in recs if r.get("table") == tbl]
            label = SUMMARY_TABLE.get((suites[0] if len(suites) == 1 else None, tbl), SUMMARY_TABLE.get(tbl, tbl))
            name = title if len(tables) == 1 else f"{title}, {label}"
            parts = []
            for rival in SUMMARY_RIVALS:
                ratios = _ratios(rs, key, hb, rival)
                if ratios:
                    geo = float(np.exp(np.mean(np.log(ratios))))
                    spread = f"{min(ratios):.2f}-{max(ratios):.2f}x, " if len(ratios) > 1 else ""
                    parts.append(f"{geo:.2f}x {_label(rival, labels)} ({spread}{len(ratios)} "
                                 f"case{'s' if len(ratios) > 1 else ''})")
            if tbl == "scaling":
                parts += _scaling_summary(rs)
            if parts:
                out.append(f"- **{name}** ({device}, {_dates(data, rs)}): {ours} " + "; ".join(parts) + ".")
    return out


def _dates(data: dict, recs: list[dict]) -> str:
    """When `recs` were measured: the file's date, or that of the later run merged in (`merge`)."""
    def date(case: str) -> str:
        later = [m["date"] for m in data.get("merged", []) if case in m.get("cases", [])]
        return str((later or [data.get("date", "?")])[-1])[:10]
    return " and ".join(sorted({date(r["case"]) for r in recs}))


def _scaling_summary(recs: list[dict]) -> list[str]:
    """Tokens/s per GPU on the most GPUs as a fraction of one GPU's, per model and implementation."""
    most = max((r.get("devices", 1) for r in recs), default=1)
    parts = []
    for moe in (False, True):
        one = {r["impl"]: r.get("tokens_per_s_per_device") for r in recs if r.get("devices") == 1 and r.get("moe") == moe}
        top = {r["impl"]: r.get("tokens_per_s_per_device") for r in recs if r.get("devices") == most and r.get("moe") == moe}
        eff = {i: top[i] / one[i] for i in top if top.get(i) and one.get(i)}
        if "jax_cute" in eff and most > 1:
            xla = f" (XLA {eff['xla']:.3f})" if "xla" in eff else ""
            parts.append(f"{'MoE expert' if moe else 'dense data'} parallel on {most} GPUs at "
                         f"{eff['jax_cute']:.3f} of one GPU's tokens/s per GPU{xla}")
    return parts


def readme_with_summary(readme: str, lines: list[str]) -> str:
    """``readme`` with the text between its summary markers replaced by ``lines``."""
    start, end = readme.index(README_START) + len(README_START), readme.index(README_END)
    return readme[:start] + "\n" + "\n".join(lines) + "\n" + readme[end:]


def report_order(files: list[str]) -> list[str]:
    """The result files among ``files`` (.json suites, .jsonl first-call records; other files are
    skipped): dense GEMM first, then grouped, launch, first call."""
    rank = {"matmul": 0, "layouts": 1, "ragged": 2, "fused": 3, "launch": 4, "collective": 5}
    kept = [f for f in files if f.endswith((".json", ".jsonl"))]
    for f in sorted(set(files) - set(kept)):
        print(f"skipping {f}: not a results file")
    return sorted(kept, key=lambda f: (f.endswith(".jsonl"),
                                       min((r for k, r in rank.items() if k in Path(f).stem), default=3), f))


def report(files: list[str], md: str, plots: str) -> str:
    out = ["# Benchmarks", "",
           "Generated by `python benchmarks/run.py --report benchmarks/results/*`; every number below is a "
           "measurement in those files: the median over rounds in which jax_cute and its rivals run interleaved "
           "in one process on fresh random data ([docs/performance.md](docs/performance.md) says how and why). "
           "Ratios > 1 mean jax_cute is faster. *failed*: that implementation did not run on that case; "
           "*XLA fallback*: jax_cute ran without its kernel.", ""]
    for f in files:
        if f.endswith(".jsonl"):  # first-call latency records (benchmarks/bench_first_call.py)
            out += first_call_section(f)
            continue
        data = json.loads(Path(f).read_text())
        stem = Path(f).stem
        suites = data.get("suites") or []
        title = " + ".join(SUITE_TITLE.get(s, s) for s in suites) or stem
        notes = [SUITE_NOTE[su] for su in suites if su in SUITE_NOTE]
        tables = {r.get("table") for r in data.get("records", [])}
        own = own_section(tables)
        if own:   # a file of tables with their own story
            title, notes = own[0], [own[1]]
        print(f"{f}: {data.get('device', '?')}, {data.get('date', '?')}")
        out += [f"## {title}", "", " ".join([_provenance(data, f), *notes]), ""]
        for suite, err in (data.get("suite_errors") or {}).items():
            out += [f"- suite `{suite}` did not finish: {err}", ""]
        recs = data.get("records", [])
        for tbl, key, unit, hb, sub, digits in SECTIONS:
            rs = [r for r in recs if r.get("table") == tbl]
            if not rs:
                continue
            labels = _suite_labels(list({r.get("suite") for r in rs}))
            out += [f"### {sub}", ""] + table(rs, key, unit, hb, digits, labels) + [""]
            png = Path(plots) / f"{stem}_{tbl}.png"
            if plot(rs, key, unit, f"{sub} — {data.get('device', '?')}, {str(data.get('date', '?'))[:10]}", png,
                    labels):
                rel = os.path.relpath(png, Path(md).resolve().parent if Path(md).parent != Path("") else ".")
                out += [f"![{sub}]({rel})", ""]
            fails = [r for r in rs if r.get("error")]
            if fails:
                out += ["<details><summary>failures</summary>", ""]
                out += [f"- {r['case']} / {r['impl']}: {r['error']}" for r in fails] + ["", "</details>", ""]
        file_labels = _suite_labels(suites)
        out += traffic_table(recs, file_labels) + scaling_table(recs, file_labels)
    text = "\n".join(out).rstrip() + "\n"
    Path(md).write_text(text)
    print(f"wrote {md} ({len(text.encode())} bytes) and plots under {plots}")
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", help="comma-separated: " + ",".join(SUITES))
    p.add_argument("--out", help="results JSON (with --suite)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: checks the scripts, not speed")
    p.add_argument("--rounds", type=int, help="timed rounds per case (default 7)")
    p.add_argument("--cases", metavar="REGEX", help="measure only the cases whose label this matches (re.search)")
    p.add_argument("--time-limit", type=float, metavar="S",
                   help="stop the suites after S seconds in all, keeping the cases they finished")
    p.add_argument("--report", nargs="+", metavar="JSON", help="write BENCHMARKS.md and plots from these files")
    p.add_argument("--merge", nargs=3, metavar=("INTO", "NEW", "LABEL"),
                   help="replace INTO's records of the cases NEW measured by NEW's; LABEL names them in the report")
    p.add_argument("--md", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--plots", default=str(HERE / "plots"))
    args = p.parse_args(argv)
    if args.merge:
        data = merge(*args.merge)
        print(f"{args.merge[0]}: {len(data['records'])} records, {args.merge[2]} from {args.merge[1]}")
    elif args.report:
        files = report_order(args.report)
        report(files, args.md, args.plots)
        readme = ROOT / "README.md"
        if args.md == str(ROOT / "BENCHMARKS.md") and README_START in readme.read_text():
            readme.write_text(readme_with_summary(readme.read_text(), summary(files)))
            print(f"updated the results summary in {readme}")
    elif args.suite:
        suites = [s.strip() for s in args.suite.split(",") if s.strip()]
        unknown = [s for s in suites if s not in SUITES]
        if unknown or not args.out:
            p.error(f"unknown suites {unknown}" if unknown else "--out is required with --suite")
        extra = ((["--smoke"] if args.smoke else []) + (["--rounds", str(args.rounds)] if args.rounds else [])
                 + (["--cases", args.cases] if args.cases else []))
        run_suites(suites, args.out, extra, args.time_limit, args.cases)
    else:
        p.error("give --suite ... --out ..., or --report FILES")


if __name__ == "__main__":
    main()

"""Did XLA put our custom call into a command buffer (a CUDA graph)? Read from an HLO dump.

XLA wraps the ops it records into one graph in a computation whose name starts with
``command_buffer``; the optimized-HLO dump (``--xla_dump_to``) shows which ops sit inside.
"""

from __future__ import annotations

import glob
import os


def graph_flags(dump_dir: str) -> str:
    return (f"--xla_gpu_graph_min_graph_size=1 --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
            f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text")


def child_env(dump_dir: str, **extra: str) -> dict:
    """The environment of a capture probe run as a child of a GPU test process: graph flags,
    and no preallocation (the parent already holds most of the GPU's memory)."""
    return dict(os.environ, XLA_FLAGS=graph_flags(dump_dir), XLA_PYTHON_CLIENT_PREALLOCATE="false", **extra)


def report(dump_dir: str, call, runs: int = 5) -> None:
    """Print ``CAPTURED True|False`` and the evidence, after the caller checked correct results
    with new inputs.

    ``call()`` runs the jitted function once more on fixed inputs. Our handler's execute stage
    counts launches; a call recorded into a CUDA graph runs that host code when XLA records the
    graph, not when it replays it. So ``runs`` further calls that add fewer than ``runs``
    launches ran our kernel from graph replays. A profile of those calls shows the graph
    launches themselves (``cudaGraphLaunch``) as a second witness.
    """
    import jax

    from jax_cute import runtime

    call()
    before = runtime.stats()["launches"]
    with jax.profiler.trace(os.path.join(dump_dir, "trace")):
        for _ in range(runs):
            jax.block_until_ready(call())
    added = runtime.stats()["launches"] - before
    blobs = b"".join(open(p, "rb").read() for p in glob.glob(os.path.join(dump_dir, "trace", "**", "*"),
                                                                recursive=True) if os.path.isfile(p))
    graph_launches = blobs.count(b"cudaGraphLaunch") + blobs.count(b"cuGraphLaunch")
    print("CAPTURED", added < runs, f"(handler ran {added} times for {runs} calls; "
          f"{graph_launches} graph launches in the profile)")

"""Did XLA put our custom call into a command buffer (a CUDA graph)? Read from an HLO dump.

XLA wraps the ops it records into one graph in a computation whose name starts with
``command_buffer``; the optimized-HLO dump (``--xla_dump_to``) shows which ops sit inside.
"""

from __future__ import annotations

import glob
import os
import re


def graph_flags(dump_dir: str) -> str:
    return (f"--xla_gpu_graph_min_graph_size=1 --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
            f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text")


def report(dump_dir: str, runs: int) -> None:
    """Print ``CAPTURED True|False`` and the evidence.

    The proof: our handler's execute stage counts its launches. A call recorded into a CUDA
    graph runs that host code when it is captured, not when the graph is replayed, so after
    ``runs`` calls with new inputs (all checked correct by the caller) fewer launches than
    runs means the kernel ran from graph replays. The dump's command-buffer computations, where
    this XLA shows them in HLO, are printed as well.
    """
    from jax_cute import runtime

    launches = runtime.stats()["launches"]
    text = "".join(open(p).read() for p in sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))))
    blocks = re.split(r"\n\s*\n", text)
    graphs = [b for b in blocks if re.match(r"\s*(ENTRY\s+)?%?command_buffer", b)]
    mentions = sorted(os.path.basename(p) for p in glob.glob(os.path.join(dump_dir, "*"))
                      if "command_buffer" in open(p, errors="ignore").read())[:5]
    print("CAPTURED", launches < runs, f"(handler launches {launches} for {runs} calls)")
    print("files mentioning command_buffer:", mentions)
    print("command buffer computations:", [b.strip().split("\n")[0][:80] for b in graphs])
    print("computations holding our call:",
          [b.strip().split("\n")[0][:80] for b in blocks if "jax_cute_launch" in b])

"""Block-scaled fp8 (DeepSeek-V3 / DeepGEMM's recipe): quantization, scaled products, training.

- :func:`quantize`, :func:`quantize_grouped`, :func:`dequantize`, :class:`BlockScaled`;
- scaled products: ``jax_cute.matmul``/``dot_general``/``ragged_dot`` take :class:`BlockScaled`
  operands (``ops.py``), :func:`ragged_k_dot` is the grouped weight gradient;
- training: :func:`linear` / :func:`grouped_linear` (``custom_vjp``: every GEMM of the forward and
  backward pass in fp8) and :class:`Blockwise`, the recipe ``jax_cute.kernelize(fn, fp8=...)`` takes;
  :data:`WEIGHTS`, the checkpoint name of their quantized weights.

See docs/fp8.md for the numerics and what the Hopper kernel will implement.
"""

from jax_cute.fp8.quantize import BLOCK, BlockScaled, dequantize, quantize, quantize_grouped
from jax_cute.fp8.ops import ragged_k_dot, scaled_dot_general, scaled_matmul, scaled_ragged_dot
from jax_cute.fp8.linear import WEIGHTS, Blockwise, grouped_linear, linear

__all__ = ["BLOCK", "WEIGHTS", "BlockScaled", "Blockwise", "dequantize", "grouped_linear", "linear", "quantize",
           "quantize_grouped", "ragged_k_dot",
           "scaled_dot_general", "scaled_matmul", "scaled_ragged_dot"]

"""The problem model: a GEMM's operands as layouts over buffers, and the flat problem a kernel takes.

``gemm_layouts`` (dense: A is (M, K, L), B (N, K, L), C (M, N, L)) and ``ragged_layouts``
(grouped) say which buffer stride each logical mode has, and how batching and autodiff rewrite
them; ``gemm_plan`` (and ``ragged_layouts.flatten_grouped``) turn them into the one extent and
stride per mode a kernel takes, or say why none can. Below dispatch, above the kernels: no JAX
rule lives here, only layouts.
"""

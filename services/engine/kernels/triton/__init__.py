"""Triton kernels of the CUDA fast path, one kernel per module.

rms_norm (fused residual add + RMSNorm), swiglu (silu(gate) * up), rotary_kv_store (rotary
embedding of q/k fused with the paged KV-cache write), decode_attention (split-K
flash-decoding over the paged cache), prefill_attention (varlen causal attention over a cached
prefix), paged_kv (the block-table tile load both attention kernels share) and skinny_matmul
(small-row matmul chosen per shape against cuBLAS). Each module imports Triton itself, so this
package imports on machines without it; kernels/reference.py states what each one computes.
"""

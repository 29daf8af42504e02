"""Tensor parallelism: one model split over N ranks of one engine worker group.

`sharding` is the arithmetic (which heads, rows and columns each rank holds), `weights` splits
full tensors into a rank's shards and builds the rank's model, `group` wraps the process group
(NCCL on CUDA, gloo on CPU) and carries each step's inputs from rank 0 to the others, `launch`
starts the group from the engine worker and `rank_main` is the loop of ranks 1..N-1.
"""

"""Multi-LoRA serving inside the engine: adapters by name, mixed-adapter batches in one forward.

Modules, from the files on disk to the math:
- config: LoRAConfig (slots, host cache, rank limit, adapter root, time-slicing, loader
  threads, GPU kernel options).
- paths: an adapter path must resolve under adapter_root; SHA-256 of the files.
- peft_config: adapter_config.json parsed and checked (what is refused, and why).
- projections: the seven PEFT modules as slices of the engine's four fused projections.
- loader / weights: safetensors → AdapterWeights in the fused layout, scale folded into B.
- records: registration (full validation once) and the AdapterRecord the registry keeps.
- manager: host cache and device slots, LRU, pins, loads on a background thread (no tensors).
- batch: which rows use which slot (segments; grouped layout for the GPU kernels).
- slots: the stacked, rank-padded slot buffers per layer and projection.
- torch_ops / runtime / wrap: the per-segment math, the per-step state, the model hook.
The GPU kernels are services/engine/kernels/triton/lora_shrink.py and lora_expand.py.
"""

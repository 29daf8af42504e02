"""The engine library: model, paged KV cache, scheduler and sampler, usable in-process."""

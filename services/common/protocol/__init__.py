"""The protocol layer: what the router, the tokenizer and the engine agree on.

Plain Python domain types and their wire encodings, shared so that no service imports another:
`sampling_params` (a request's `SamplingParams` and prompt checks, one set of messages for every
caller), `engine_record` (an engine's entry in the shared registry), `dummy_shapes` (the named
`dummy:` model shapes a model name may refer to) and `codec` (the one protobuf <-> domain
conversion that both sides of a hop use). Nothing here imports torch or a service package.
"""

"""Internal benchmarks of Sluice: engine, stack, tokenize hop and GPU kernels, with their results.

They live beside the product, not inside it: the installed wheel ships `services`, `loadtest`
(the harness behind `sluice bench`) and `protos`, never this package. Run each from the
repository root as `python -m benchmarks.NAME --help`; raw reports go to `benchmarks/results/`.
"""

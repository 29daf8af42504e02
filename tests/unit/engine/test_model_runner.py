"""CpuModelRunner on the default model (GGUF-converted) and on dummy shapes; input validation."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgumentError
from services.common.model_files import resolve_model
from services.engine.cpu_runner import CpuModelRunner
from services.engine.forward_batch import ScheduledBatch, ScheduledSequence
from services.engine.model_runner import cpu_has_native_bfloat16, default_dtype
from tests.unit.engine.models.helpers import BlockAllocator, step

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def default_runner() -> CpuModelRunner:
    # float32 pinned: compared with transformers in float32.
    return CpuModelRunner(
        resolve_model(None), dtype=torch.float32, block_size=BLOCK_SIZE, kv_cache_bytes=64 << 20
    )


@pytest.fixture(scope="module")
def tiny_runner() -> CpuModelRunner:
    # float32 pinned: batched and single rows are compared at 1e-5.
    return CpuModelRunner(
        resolve_model("dummy:tiny"),
        dtype=torch.float32,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=4 << 20,
    )


@pytest.mark.slow
def test_default_model_matches_transformers(default_runner: CpuModelRunner) -> None:
    from transformers import AutoModelForCausalLM

    files = default_runner.model_files
    reference = AutoModelForCausalLM.from_pretrained(files.weights_dir, dtype=torch.float32)
    config = default_runner.model_config
    assert config.architecture == "LlamaForCausalLM"
    assert config.vocab_size == 49152 and config.num_layers == 30
    assert config.num_kv_heads == 3 and config.head_dim == 64
    assert 2 in config.eos_token_ids
    allocator = BlockAllocator(default_runner.num_blocks, BLOCK_SIZE, seed=3)
    prompts = {0: list(range(300, 320)), 1: [1, 9690, 198, 2683, 314, 253, 1345]}
    ours: dict[int, list[torch.Tensor]] = {seq: [] for seq in prompts}
    pieces = [(seq, list(tokens), 0, True) for seq, tokens in prompts.items()]
    for _ in range(4):  # a prefill of both, then three decode steps over the paged cache
        logits = default_runner.execute(step(allocator, pieces))
        pieces = []
        for row, (seq, history) in enumerate(prompts.items()):
            ours[seq].append(logits[row])
            token = int(logits[row].argmax())
            pieces.append((seq, [token], len(history), True))
            history.append(token)
    for seq, history in prompts.items():
        with torch.no_grad():  # one reference pass gives the logits at every position
            expected = reference(torch.tensor([history[:-1]])).logits[0, -4:]
        for index, row in enumerate(ours[seq]):
            torch.testing.assert_close(row, expected[index], atol=2e-3, rtol=1e-3)
            assert int(row.argmax()) == int(expected[index].argmax())


@pytest.mark.parametrize("shape", ["tiny", "smollm2-135m"])
def test_dummy_shapes_build_and_give_finite_logits(shape: str) -> None:
    runner = CpuModelRunner(resolve_model(f"dummy:{shape}"), kv_cache_bytes=8 << 20, seed=7)
    assert runner.num_blocks > 0
    assert runner.model_config.vocab_size == 49152
    assert runner.model_config.eos_token_ids == (2,)
    batch = step(BlockAllocator(runner.num_blocks, 16), [(0, [5, 6, 7, 8], 0, True)])
    logits = runner.execute(batch)
    assert logits.shape == (1, 49152)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0


def test_dummy_weights_are_seeded() -> None:
    files = resolve_model("dummy:tiny")
    first = CpuModelRunner(files, kv_cache_bytes=1 << 20, seed=1)
    same = CpuModelRunner(files, kv_cache_bytes=1 << 20, seed=1)
    other = CpuModelRunner(files, kv_cache_bytes=1 << 20, seed=2)
    logits = [
        runner.execute(step(BlockAllocator(runner.num_blocks, 16), [(0, [5, 6, 7], 0, True)]))
        for runner in (first, same, other)
    ]
    assert torch.equal(logits[0], logits[1])
    assert not torch.equal(logits[0], logits[2])


def test_only_rows_that_need_logits_are_returned(tiny_runner: CpuModelRunner) -> None:
    allocator = BlockAllocator(tiny_runner.num_blocks, BLOCK_SIZE)
    batch = step(allocator, [(0, [1, 2, 3], 0, False), (1, [4, 5], 0, True)])
    logits = tiny_runner.execute(batch)
    assert logits.shape == (1, 49152)
    alone = tiny_runner.execute(step(allocator, [(2, [4, 5], 0, True)]))
    torch.testing.assert_close(logits[0], alone[0], atol=1e-5, rtol=1e-5)


def test_decode_in_a_batch_equals_decode_alone(tiny_runner: CpuModelRunner) -> None:
    allocator = BlockAllocator(tiny_runner.num_blocks, BLOCK_SIZE, seed=5)
    prompts = [[7] * 3, list(range(10, 50)), [9, 8, 7, 6, 5]]
    tiny_runner.execute(step(allocator, [(i, p, 0, True) for i, p in enumerate(prompts)]))
    together = tiny_runner.execute(
        step(allocator, [(i, [11], len(p), True) for i, p in enumerate(prompts)])
    )
    # The same decode for sequence 1 again, alone, over the same cache (same position).
    alone = tiny_runner.execute(step(allocator, [(1, [11], len(prompts[1]), True)]))
    torch.testing.assert_close(together[1], alone[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(together[0], together[1])


def test_empty_batch_gives_no_rows(tiny_runner: CpuModelRunner) -> None:
    assert tiny_runner.execute(ScheduledBatch([])).shape == (0, 49152)


@pytest.mark.parametrize(
    "sequence, message",
    [
        (ScheduledSequence(0, [1, 2, 3], 0, [], True), "blocks cannot hold"),
        (ScheduledSequence(0, [1, 49152], 0, [0], True), "token ids"),
        (ScheduledSequence(0, [-1], 0, [0], True), "token ids"),
        (ScheduledSequence(0, [], 0, [0], True), "no tokens"),
        (ScheduledSequence(0, [1], 2048, list(range(129)), True), "max_model_len"),
    ],
)
def test_bad_batches_are_refused(
    tiny_runner: CpuModelRunner, sequence: ScheduledSequence, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        tiny_runner.execute(ScheduledBatch([sequence]))


def test_max_model_len_caps_context() -> None:
    runner = CpuModelRunner(resolve_model("dummy:tiny"), kv_cache_bytes=1 << 20, max_model_len=64)
    assert runner.model_config.max_model_len == 64
    assert runner.dtype == default_dtype("cpu") and runner.device.type == "cpu"


def test_auto_dtype_is_bfloat16_only_where_the_cpu_has_native_bf16(monkeypatch) -> None:
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert cpu_has_native_bfloat16() == native
    assert default_dtype("cpu") == (torch.bfloat16 if native else torch.float32)
    assert default_dtype("cuda") == torch.bfloat16
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False)
    assert default_dtype("cpu") == torch.float32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert default_dtype(torch.device("cpu")) == torch.bfloat16


def test_bfloat16_on_cpu_gives_finite_float32_logits() -> None:
    runner = CpuModelRunner(
        resolve_model("dummy:tiny"), dtype=torch.bfloat16, kv_cache_bytes=1 << 20
    )
    assert runner.kv_cache.layers[0][0].dtype == torch.bfloat16
    allocator = BlockAllocator(runner.num_blocks, BLOCK_SIZE)
    runner.execute(step(allocator, [(0, [1, 2, 3, 4, 5], 0, True), (1, [7, 8], 0, True)]))
    logits = runner.execute(step(allocator, [(0, [9], 5, True), (1, [9], 2, True)]))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_unknown_backend_is_invalid() -> None:
    with pytest.raises(InvalidArgumentError, match="backend"):
        CpuModelRunner(resolve_model("dummy:tiny"), kv_cache_bytes=1 << 20, backend="nope")


def test_execute_greedy_equals_argmax_of_execute(tiny_runner: CpuModelRunner) -> None:
    """The all-greedy fast path picks exactly the argmax of the full logits (ties: lowest id)."""
    allocator = BlockAllocator(tiny_runner.num_blocks, BLOCK_SIZE, seed=5)
    generator = torch.Generator().manual_seed(11)
    vocab = tiny_runner.model_config.vocab_size
    prompts = {
        seq: torch.randint(0, vocab, (length,), generator=generator).tolist()
        for seq, length in enumerate((1, 5, 17, 40))
    }
    pieces = [(seq, tokens, 0, seq != 2) for seq, tokens in prompts.items()]
    batch = step(allocator, pieces)
    full = tiny_runner.execute(batch).argmax(dim=-1)
    fast = tiny_runner.execute_greedy(batch)
    assert fast.dtype == torch.int64 and fast.shape == (3,)
    assert fast.tolist() == full.tolist()
    model = tiny_runner.model
    with torch.inference_mode():
        hidden = torch.randn(9, tiny_runner.model_config.hidden_size, generator=generator)
        hidden[0] = 0.0  # every logit ties at 0: argmax answers token 0
        for chunk in (1000, 4096, vocab):  # a narrower last slice, even slices, one slice
            expected = model.compute_logits(hidden).argmax(dim=-1).tolist()
            assert model.compute_greedy(hidden, chunk=chunk).tolist() == expected


def test_bf16_greedy_head_equals_argmax_of_execute() -> None:
    """bf16 with the native kernels (where the CPU has AVX-512 BF16): float32 logits from the
    native head, and the fused greedy head picks exactly their argmax."""
    runner = CpuModelRunner(
        resolve_model("dummy:tiny"),
        dtype=torch.bfloat16,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=4 << 20,
    )
    kernels = runner.cpu_kernels
    assert kernels is not None
    assert (runner.model._native_head is not None) == kernels.has_greedy_head
    allocator = BlockAllocator(runner.num_blocks, BLOCK_SIZE, seed=3)
    generator = torch.Generator().manual_seed(5)
    vocab = runner.model_config.vocab_size
    prompts = {
        seq: torch.randint(0, vocab, (length,), generator=generator).tolist()
        for seq, length in enumerate((2, 9, 33))
    }
    batch = step(allocator, [(seq, tokens, 0, True) for seq, tokens in prompts.items()])
    assert runner.execute_greedy(batch).tolist() == runner.execute(batch).argmax(-1).tolist()
    with torch.inference_mode():
        hidden = torch.randn(11, runner.model_config.hidden_size, generator=generator)
        hidden = hidden.to(torch.bfloat16)
        hidden[0] = 0.0  # all logits tie at 0: token 0
        expected = runner.model.compute_logits(hidden).float().argmax(-1).tolist()
        assert runner.model.compute_greedy(hidden).tolist() == expected


@pytest.mark.parametrize("shape, block_size", [("tiny", 8), ("tiny", 32), ("smollm2-135m", 16)])
def test_native_cpu_kernels_match_pytorch_ops(shape: str, block_size: int) -> None:
    """Same weights, same steps, float32: the logits with the native CPU kernels equal those of
    the PyTorch ops over prefills, decodes of different lengths (mixed into one step with a
    prefill chunk) and a chunk over a cached prefix; tiny has head_dim 16 (the kernels' generic
    path), smollm2-135m head_dim 64 (the register-blocked one)."""

    def build(native: bool) -> CpuModelRunner:
        return CpuModelRunner(
            resolve_model(f"dummy:{shape}"),
            dtype=torch.float32,
            block_size=block_size,
            kv_cache_bytes=8 << 20,
            seed=3,
            cpu_kernels=native,
        )

    native, plain = build(True), build(False)
    assert native.cpu_kernels is not None and plain.cpu_kernels is None
    steps = [
        [(0, list(range(100, 140)), 0, True), (1, list(range(300, 310)), 0, True)],
        [(0, [7], 40, True), (1, [8], 10, True), (2, list(range(500, 525)), 0, False)],
        [(0, [9], 41, True), (1, [10], 11, True), (2, list(range(525, 530)), 25, True)],
        # Two chunks over cached prefixes after a decode, one crossing query and key tiles.
        [(0, [11], 42, True), (1, list(range(600, 637)), 12, True), (2, [12], 30, True)],
    ]
    native_blocks = BlockAllocator(native.num_blocks, block_size, seed=1)
    plain_blocks = BlockAllocator(plain.num_blocks, block_size, seed=1)
    for pieces in steps:
        expected = plain.execute(step(plain_blocks, pieces))
        got = native.execute(step(native_blocks, pieces))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_float8_kv_cache_is_refused_off_cuda_before_any_weight_is_built(monkeypatch) -> None:
    import services.engine.model_runner as model_runner

    def no_build(*args, **kwargs):
        raise AssertionError("weights built before the KV cache's dtype was checked")

    monkeypatch.setattr(model_runner, "build_model", no_build)
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype fp8 needs a CUDA device"):
        CpuModelRunner(resolve_model("dummy:tiny"), kv_cache_dtype="fp8", kv_cache_bytes=1 << 20)

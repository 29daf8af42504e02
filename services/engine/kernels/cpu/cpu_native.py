"""Native CPU kernels (cpu_native.cpp), compiled once per machine and called through ctypes.

Why: on CPU, PyTorch eager runs each small op of a decoder layer (residual add, RMSNorm,
rotary, the KV-cache write, silu * up) as its own dispatch and pass over memory, and decode
attention as a gather of every sequence's KV blocks, padded to the longest, followed by
batched matmuls and a softmax. At batch 32 on SmolLM2 that was ~40 % of a decode step; the
fused kernels here read each KV row once, straight from the paged cache, and make one pass per
fused op (measured figures in BENCHMARKS.md, "Engine on CPU"). Prefill attention is one
flash-style call for all of a step's chunks, also straight from the paged cache.

How: `cpu_kernels()` compiles the C++ file with the system's g++ (`-O3 -march=native
-fopenmp`) into the cache directory (`SLUICE_CACHE_DIR`/kernels, named by a digest of the
source, the flags, the compiler and the CPU's features), so the first start pays ~5-10 s and
later ones load the library at once. No compiler, a failed build or a failed self-check leave
the engine on its PyTorch ops (logged once). The library links no PyTorch or Python headers:
kernels take raw data pointers, so it builds in seconds and never breaks across PyTorch
versions. ctypes releases the GIL during each call. float32 and bfloat16 only; the callers
keep the PyTorch path for other dtypes and devices.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from services.common.env import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.cpp")
COMPILER = "g++"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
# Each kernel's C signature (cpu_native.cpp): pointers, int64 sizes/strides, float, int threads.
_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "rms_norm": (_P, _I, _P, _P, _P, _P, _I, _I, _F, _T),
    "silu_mul": (_P, _P, _I, _I, _T),
    "rotary": (_P, _I, _I, _I, _I, _P, _P, _P, _T),
    "kv_store": (_P, _I, _P, _I, _P, _P, _P, _I, _I),
    "decode_attention": (_P, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _T),
    "prefill_attention": (_P, _I, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _T),
    "argmax_rows": (_P, _I, _I, _I, _P, _T),
    "lora_delta": (_P, _I, _P, _I, _P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _T),
}
HEAD_TILE = 16  # vocabulary rows per packed tile of the greedy head (cpu_native.cpp)

_lock = threading.Lock()
_loaded: CpuKernels | None = None
_tried = False


class CpuKernels:
    """Typed wrappers over the compiled library; every method takes and returns CPU tensors."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for dtype, suffix in _SUFFIX.items():
            for name, argtypes in _SIGNATURES.items():
                function = getattr(library, f"sluice_{name}_{suffix}")
                function.argtypes = argtypes
                function.restype = None
                self._functions[(name, dtype)] = function
        self.has_greedy_head = bool(library.sluice_has_greedy_head())
        self._greedy_head = library.sluice_greedy_head_bf16
        self._lm_head = library.sluice_lm_head_bf16
        for function in (self._greedy_head, self._lm_head):
            function.argtypes = (_P, _I, _I, _I, _P, _I, _P, _T)
            function.restype = None

    @staticmethod
    def supports(tensor: torch.Tensor) -> bool:
        """Whether `tensor` (device and dtype) can go through these kernels."""
        return tensor.device.type == "cpu" and tensor.dtype in _SUFFIX

    def _call(self, name: str, dtype: torch.dtype, *args: int | float | None) -> None:
        self._functions[(name, dtype)](*args)

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual) * weight, x + residual); x [rows, dim] (rows may be strided)."""
        rows, dim = x.shape
        _check_rows(x, "x")
        weight = weight.to(x.dtype)  # a no-op (the same tensor) when it already matches
        out = torch.empty((rows, dim), dtype=x.dtype)
        if residual is None:
            kept, residual_pointer, kept_pointer = x, None, None
        else:
            residual = residual.contiguous()
            kept = torch.empty((rows, dim), dtype=x.dtype)
            residual_pointer, kept_pointer = residual.data_ptr(), kept.data_ptr()
        self._call(
            "rms_norm", x.dtype, x.data_ptr(), x.stride(0), residual_pointer, weight.data_ptr(),
            out.data_ptr(), kept_pointer, rows, dim, eps, torch.get_num_threads(),
        )  # fmt: skip
        return out, kept

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate_up[:, :half]) * gate_up[:, half:] for gate_up [rows, 2 * half]."""
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._call(
            "silu_mul", gate_up.dtype, gate_up.data_ptr(), out.data_ptr(), rows, width // 2,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rotate_(
        self,
        heads: torch.Tensor,
        positions: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
    ) -> torch.Tensor:
        """Rotary embedding in place on heads [tokens, num_heads, dim] (rows may be strided).

        cos/sin tables: float32 [max_positions, dim] with equal halves. Positions must lie in
        the table (the model runner checks them against max_model_len).
        """
        tokens, num_heads, dim = heads.shape
        _check_heads(heads, "rotary heads")
        positions = positions.to(torch.int64).contiguous()
        _check_index(cos_table, torch.float32, "cos_table")
        _check_index(sin_table, torch.float32, "sin_table")
        self._call(
            "rotary", heads.dtype, heads.data_ptr(), heads.stride(0), tokens, num_heads, dim,
            positions.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return heads

    def kv_store(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Write key/value [tokens, kv_heads, dim] into the caches at `slots` (int64)."""
        key, value = key.to(key_cache.dtype), value.to(key_cache.dtype)
        _check_heads(key, "key")
        _check_heads(value, "value")
        tokens, kv_heads, dim = key.shape
        _check_index(slots, torch.int64, "slots")
        self._call(
            "kv_store", key_cache.dtype, key.data_ptr(), key.stride(0), value.data_ptr(),
            value.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(),
            tokens, kv_heads * dim,
        )  # fmt: skip

    def decode_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        num_kv_heads: int,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """One query per sequence over its paged cache; query [B, H, D] → out [B, H, D].

        block_tables [B, max_blocks] int32 (each row covers its seq_lens entry), seq_lens [B]
        int32 keys per sequence. The caches are [blocks, block_size, KVH, D], contiguous.
        """
        batch, heads, dim = query.shape
        if query.stride(2) != 1:
            raise ValueError("query heads must be contiguous")
        query = query.to(key_cache.dtype)
        _check_index(seq_lens, torch.int32, "seq_lens")
        if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
            raise ValueError("block_tables must be int32 with contiguous rows")
        out = torch.empty((batch, heads, dim), dtype=query.dtype)
        self._call(
            "decode_attention", query.dtype, query.data_ptr(), query.stride(0), query.stride(1),
            key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), batch, heads,
            num_kv_heads, dim, block_size, scale, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def prefill_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_starts: torch.Tensor,
        seq_lens: torch.Tensor,
        num_kv_heads: int,
        block_size: int,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of each sequence's chunk of query tokens over its paged cache, which
        already holds the chunk's own keys and values; query [T, H, D] → out [T, H, D].

        Sequence s owns query rows [query_starts[s], query_starts[s + 1]) (int32 [S + 1]) and
        seq_lens[s] keys (int32 [S]: its cached prefix plus the chunk), its token i seeing keys
        [0, seq_lens[s] - chunk + i]; block_tables [S, max_blocks] int32. Only those rows of
        `out` (made when None; rows may be strided, heads contiguous) are written.
        """
        tokens, heads, dim = query.shape
        if query.stride(2) != 1:
            raise ValueError("query heads must be contiguous")
        query = query.to(key_cache.dtype)
        _check_index(query_starts, torch.int32, "query_starts")
        _check_index(seq_lens, torch.int32, "seq_lens")
        if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
            raise ValueError("block_tables must be int32 with contiguous rows")
        num_seqs = seq_lens.shape[0]
        if query_starts.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
            raise ValueError("query_starts, seq_lens and block_tables disagree on the sequences")
        if out is None:
            out = torch.empty((tokens, heads, dim), dtype=query.dtype)
        elif out.dtype != query.dtype or out.shape != query.shape:
            raise ValueError("out must match the query's shape and the cache's dtype")
        _check_heads(out, "out")
        self._call(
            "prefill_attention", query.dtype, query.data_ptr(), query.stride(0), query.stride(1),
            key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), query_starts.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
            out.stride(0), num_seqs, heads, num_kv_heads, dim, block_size, scale,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def argmax_rows(self, values: torch.Tensor) -> torch.Tensor:
        """int64 index of each row's maximum (the first on ties, as torch.argmax)."""
        rows, width = values.shape
        _check_rows(values, "values")
        result = torch.empty(rows, dtype=torch.int64)
        self._call(
            "argmax_rows", values.dtype, values.data_ptr(), values.stride(0), rows, width,
            result.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return result

    def lora_delta(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        rows: torch.Tensor,
        row_slots: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        ranks: torch.Tensor,
        slice_offsets: torch.Tensor,
    ) -> None:
        """In place: y[rows[n], slice i] += (x[rows[n]] A[s, i, :k]ᵀ) B[s, slice i, :k]ᵀ for
        s = row_slots[n], k = ranks[s] (0: skipped), float32 math, each output rounded once.

        x [T, in] and y [T, out] of one dtype (contiguous rows); rows and row_slots int32 [n];
        a float32 [slots, slices, max_rank, in] and bt, B transposed, float32
        [slots, max_rank, out] (contiguous); ranks int32 [slots]; slice_offsets int64
        [slices + 1] (the first 0, the last out).
        """
        _check_rows(x, "x")
        _check_rows(y, "y")
        if x.dtype != y.dtype:
            raise ValueError("lora_delta needs x and y of one dtype")
        _check_index(a, torch.float32, "a")
        _check_index(bt, torch.float32, "bt")
        for tensor, name in ((rows, "rows"), (row_slots, "row_slots"), (ranks, "ranks")):
            _check_index(tensor, torch.int32, name)
        _check_index(slice_offsets, torch.int64, "slice_offsets")
        slots, slices, max_rank, in_features = a.shape
        if bt.shape != (slots, max_rank, y.shape[1]) or x.shape[1] != in_features:
            raise ValueError("lora_delta: x, y, a and bt shapes disagree")
        self._call(
            "lora_delta", x.dtype, x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0),
            rows.data_ptr(), row_slots.data_ptr(), rows.numel(), a.data_ptr(), bt.data_ptr(),
            ranks.data_ptr(), slice_offsets.data_ptr(), slices, max_rank, in_features,
            y.shape[1], torch.get_num_threads(),
        )  # fmt: skip

    def greedy_head_supports(self, weight: torch.Tensor) -> bool:
        """Whether `greedy_head` can serve this LM head weight (bf16 on an AVX-512 BF16 CPU)."""
        return self.has_greedy_head and weight.dtype == torch.bfloat16

    @staticmethod
    def pack_greedy_head(weight: torch.Tensor) -> torch.Tensor:
        """The bf16 LM head [vocab, dim] in greedy_head's layout, done once: [tiles, dim / 2,
        16, 2] (pairs of hidden elements for 16 vocabulary rows; dim padded to even, the
        vocabulary to whole tiles, with zeros that are never chosen)."""
        vocab, dim = weight.shape
        tiles = -(-vocab // HEAD_TILE)
        padded = torch.zeros(tiles * HEAD_TILE, dim + dim % 2, dtype=weight.dtype)
        padded[:vocab, :dim] = weight
        return padded.view(tiles, HEAD_TILE, -1, 2).permute(0, 2, 1, 3).contiguous()

    def greedy_head(self, hidden: torch.Tensor, packed: torch.Tensor, vocab: int) -> torch.Tensor:
        """int64 argmax over the vocabulary of hidden [rows, dim] @ weight.T (bf16, the weight
        packed by `pack_greedy_head`): exactly the argmax of `lm_head`'s float32 logits (lowest
        id on ties), without writing them."""
        rows, dim = _check_head(hidden, packed, vocab)
        result = torch.empty(rows, dtype=torch.int64)
        self._greedy_head(
            hidden.data_ptr(), hidden.stride(0), rows, dim, packed.data_ptr(), vocab,
            result.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return result

    def lm_head(self, hidden: torch.Tensor, packed: torch.Tensor, vocab: int) -> torch.Tensor:
        """float32 logits [rows, vocab] of hidden [rows, dim] @ weight.T (bf16, the weight
        packed by `pack_greedy_head`), accumulated in float32 and never rounded to bf16."""
        rows, dim = _check_head(hidden, packed, vocab)
        logits = torch.empty((rows, vocab), dtype=torch.float32)
        self._lm_head(
            hidden.data_ptr(), hidden.stride(0), rows, dim, packed.data_ptr(), vocab,
            logits.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return logits


def cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, building them on first use; None where they cannot be had."""
    global _loaded, _tried
    with _lock:
        if not _tried:
            _tried = True
            _loaded = _load()
        return _loaded


def library_path() -> Path:
    """Where this machine's build of the library lives (named by everything it depends on)."""
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(" ".join((COMPILER, *FLAGS)).encode())
    digest.update(_compiler_version().encode())
    digest.update(_cpu_features().encode())
    return Path(cache_dir()) / "kernels" / f"cpu_native-{digest.hexdigest()[:16]}.so"


def build(target: Path) -> None:
    """Compile the library to `target` (atomically: a temporary file, then a rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(descriptor)
    try:
        command = [COMPILER, *FLAGS, str(SOURCE), "-o", temporary]
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
        if completed.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{completed.stderr[-2000:]}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _load() -> CpuKernels | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        logger.info("native CPU kernels: not built on %s/%s", platform.system(), platform.machine())
        return None
    if shutil.which(COMPILER) is None:
        logger.warning("native CPU kernels off: no %s on PATH (PyTorch ops instead)", COMPILER)
        return None
    try:
        path = library_path()
        if not path.exists():
            logger.info("building native CPU kernels into %s", path)
            build(path)
        kernels = CpuKernels(ctypes.CDLL(str(path)))
        _self_check(kernels)
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError, AttributeError) as exc:
        logger.warning("native CPU kernels off (PyTorch ops instead): %s", exc)
        return None
    logger.info("native CPU kernels loaded from %s", path)
    return kernels


def _self_check(kernels: CpuKernels) -> None:
    """Two kernels on small inputs against PyTorch, so that a library that loads but computes
    wrongly (a miscompile, a foreign build) is never used; raises on a mismatch."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=generator)
    weight = torch.rand(40, generator=generator)
    out, _ = kernels.rms_norm(x, None, weight, 1e-6)
    expected = torch.nn.functional.rms_norm(x, (40,), weight, 1e-6)
    values = torch.randn(5, 1000, generator=generator)
    if not torch.allclose(out, expected, atol=1e-5) or not torch.equal(
        kernels.argmax_rows(values), values.argmax(-1)
    ):
        raise RuntimeError("self-check against PyTorch failed")


def _check_head(hidden: torch.Tensor, packed: torch.Tensor, vocab: int) -> tuple[int, int]:
    _check_rows(hidden, "hidden")
    if hidden.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16:
        raise ValueError("the bf16 LM head takes bfloat16 hidden states and weights")
    rows, dim = hidden.shape
    if packed.shape[0] * HEAD_TILE < vocab or packed.shape[1] * 2 < dim:
        raise ValueError("the packed head does not match the hidden states")
    return rows, dim


def _check_rows(tensor: torch.Tensor, name: str) -> None:
    if tensor.dim() != 2 or tensor.stride(1) != 1:
        raise ValueError(f"{name} must be [rows, width] with contiguous rows")


def _check_index(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if tensor.dtype != dtype or not tensor.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor")


def _check_heads(tensor: torch.Tensor, name: str) -> None:
    if tensor.stride(2) != 1 or tensor.stride(1) != tensor.shape[2]:
        raise ValueError(f"{name} must be contiguous within a token")


def _compiler_version() -> str:
    try:
        completed = subprocess.run(
            [COMPILER, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return completed.stdout.splitlines()[0] if completed.stdout else ""


def _cpu_features() -> str:
    """The CPU's feature flags (the build uses -march=native)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return line.strip()
    except OSError:
        pass
    return platform.processor()

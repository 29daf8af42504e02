// Native CPU kernels of the torch backend's CPU path (see cpu_native.py, which compiles this
// file once per machine and calls it through ctypes with tensor data pointers).
//
// Each kernel fuses what PyTorch eager runs as several small ops (each a dispatch, an
// allocation and a pass over memory): residual add + RMSNorm, silu(gate) * up, rotary
// embedding in place, the paged KV-cache write, decode and causal prefill attention straight
// from the paged cache (no gather copy, no padding to the longest sequence, no masks), and a
// row-wise argmax. Every kernel
// computes in float32 and exists for float32 and bfloat16 tensors (bfloat16 is stored as its
// upper 16 bits and rounded to nearest even, as PyTorch does). Threads: OpenMP with the count
// the caller passes (PyTorch's own thread count), inside PyTorch's OpenMP runtime.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using bf16 = uint16_t;

inline float to_float(float value) { return value; }
inline float to_float(bf16 value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

template <typename T>
inline T from_float(float value);
template <>
inline float from_float<float>(float value) {
  return value;
}
template <>
inline bf16 from_float<bf16>(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((bits >> 16) | 0x40u);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<bf16>(bits >> 16);
}

// Sixteen float32 lanes: AVX-512 registers where the build has them, else a plain array that
// the compiler vectorizes as it can. Kernels work in chunks of kLanes with scalar tails.
constexpr int64_t kLanes = 16;
#if defined(__AVX512F__)
struct Lanes {
  __m512 v;
};
inline Lanes lanes_zero() { return {_mm512_setzero_ps()}; }
inline Lanes lanes_set(float value) { return {_mm512_set1_ps(value)}; }
inline Lanes lanes_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Lanes lanes_load(const bf16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline void lanes_store(float* p, Lanes a) { _mm512_storeu_ps(p, a.v); }
inline void lanes_store(bf16* p, Lanes a) {
  __m512i bits = _mm512_castps_si512(a.v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
inline Lanes operator+(Lanes a, Lanes b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Lanes operator-(Lanes a, Lanes b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Lanes operator*(Lanes a, Lanes b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float reduce_add(Lanes a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Lanes a) {
  float values[kLanes];
  _mm512_storeu_ps(values, a.v);
  float best = values[0];
  for (int64_t i = 1; i < kLanes; ++i) best = values[i] > best ? values[i] : best;
  return best;
}
inline Lanes lanes_max(Lanes a, Lanes b) { return {_mm512_max_ps(a.v, b.v)}; }
#else
struct Lanes {
  float v[kLanes];
};
inline Lanes lanes_set(float value) {
  Lanes r;
  for (int64_t i = 0; i < kLanes; ++i) r.v[i] = value;
  return r;
}
inline Lanes lanes_zero() { return lanes_set(0.0f); }
template <typename T>
inline Lanes lanes_load(const T* p) {
  Lanes r;
  for (int64_t i = 0; i < kLanes; ++i) r.v[i] = to_float(p[i]);
  return r;
}
template <typename T>
inline void lanes_store(T* p, Lanes a) {
  for (int64_t i = 0; i < kLanes; ++i) p[i] = from_float<T>(a.v[i]);
}
#define SLUICE_LANEWISE(NAME, EXPR)                          \
  inline Lanes NAME(Lanes a, Lanes b) {                      \
    Lanes r;                                                 \
    for (int64_t i = 0; i < kLanes; ++i) r.v[i] = (EXPR);    \
    return r;                                                \
  }
SLUICE_LANEWISE(operator+, a.v[i] + b.v[i])
SLUICE_LANEWISE(operator-, a.v[i] - b.v[i])
SLUICE_LANEWISE(operator*, a.v[i] * b.v[i])
SLUICE_LANEWISE(lanes_max, a.v[i] > b.v[i] ? a.v[i] : b.v[i])
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return a * b + c; }
inline float reduce_add(Lanes a) {
  float total = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) total += a.v[i];
  return total;
}
inline float reduce_max(Lanes a) {
  float best = a.v[0];
  for (int64_t i = 1; i < kLanes; ++i) best = a.v[i] > best ? a.v[i] : best;
  return best;
}
#endif

// exp(x) for float32 that vectorizes (no libm call): x = n ln2 + r with |r| <= ln2 / 2, a
// degree-6 polynomial for exp(r) (relative error ~2e-7, Cephes' coefficients), times 2^n built
// in the exponent bits. Inputs below -87.3 give 0, which softmax and silu want.
constexpr float kExpMax = 88.3f, kExpMin = -87.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;  // ln 2 = high + low
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float fast_exp(float x) {
  x = x < kExpMax ? x : kExpMax;
  const bool underflow = x < kExpMin;
  x = x > kExpMin ? x : kExpMin;
  const float n = std::nearbyint(x * kLog2e);
  const float r = x - n * kLn2High - n * kLn2Low;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}

// fast_exp on sixteen lanes.
#if defined(__AVX512F__)
inline Lanes lanes_exp(Lanes a) {
  __m512 x = _mm512_min_ps(a.v, _mm512_set1_ps(kExpMax));
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 result = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return {_mm512_mask_mov_ps(result, underflow, _mm512_setzero_ps())};
}
#else
inline Lanes lanes_exp(Lanes a) {
  Lanes r;
  for (int64_t i = 0; i < kLanes; ++i) r.v[i] = fast_exp(a.v[i]);
  return r;
}
#endif
inline Lanes operator/(Lanes a, Lanes b) {
#if defined(__AVX512F__)
  return {_mm512_div_ps(a.v, b.v)};
#else
  Lanes r;
  for (int64_t i = 0; i < kLanes; ++i) r.v[i] = a.v[i] / b.v[i];
  return r;
#endif
}

// Below this many elements of work a kernel runs on the calling thread alone: waking a
// second thread costs more than it saves.
constexpr int64_t kMinWorkPerThread = 1 << 15;

inline int threads_for(int64_t work, int requested) {
  if (requested <= 1 || work < 2 * kMinWorkPerThread) return 1;
  int64_t useful = work / kMinWorkPerThread;
  return static_cast<int>(useful < requested ? useful : requested);
}

// Per-thread scratch of any element type, reused across calls (one buffer per type).
template <typename E>
inline E* thread_buffer(int64_t size) {
  thread_local std::vector<E> buffer;
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// out = rmsnorm(x + residual) * weight; residual_out = x + residual (rounded to T first, as an
// eager add would be). residual and residual_out may be null (then no add).
template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* residual, const T* weight, T* out,
              T* residual_out, int64_t rows, int64_t dim, float eps, int threads) {
  const int64_t vector_end = dim - dim % kLanes;
#pragma omp parallel for num_threads(threads_for(rows * dim, threads)) schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    float* summed = thread_buffer<float>(dim);
    const T* source = x + row * x_stride;
    Lanes squares = lanes_zero();
    float tail_squares = 0.0f;
    for (int64_t i = 0; i < dim; i += kLanes) {
      if (i < vector_end) {
        Lanes value = lanes_load(source + i);
        if (residual != nullptr) {
          lanes_store(residual_out + row * dim + i, value + lanes_load(residual + row * dim + i));
          value = lanes_load(residual_out + row * dim + i);  // the rounded sum
        }
        lanes_store(summed + i, value);
        squares = fma(value, value, squares);
        continue;
      }
      for (int64_t j = i; j < dim; ++j) {
        float value = to_float(source[j]);
        if (residual != nullptr) {
          residual_out[row * dim + j] = from_float<T>(value + to_float(residual[row * dim + j]));
          value = to_float(residual_out[row * dim + j]);
        }
        summed[j] = value;
        tail_squares += value * value;
      }
    }
    const float total = reduce_add(squares) + tail_squares;
    const float inverse = 1.0f / std::sqrt(total / static_cast<float>(dim) + eps);
    T* target = out + row * dim;
    for (int64_t i = 0; i < vector_end; i += kLanes) {
      lanes_store(target + i, lanes_load(summed + i) * lanes_set(inverse) * lanes_load(weight + i));
    }
    for (int64_t j = vector_end; j < dim; ++j) {
      target[j] = from_float<T>(summed[j] * inverse * to_float(weight[j]));
    }
  }
}

// out[row] = silu(gate_up[row, :half]) * gate_up[row, half:] (silu rounded to T first, as in
// eager PyTorch).
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t half, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * half, threads)) schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    const T* gate = gate_up + row * 2 * half;
    const T* up = gate + half;
    T* target = out + row * half;
    const int64_t vector_end = half - half % kLanes;
    for (int64_t i = 0; i < vector_end; i += kLanes) {
      const Lanes g = lanes_load(gate + i);
      T activated[kLanes];  // silu rounded to T, as eager PyTorch stores it
      lanes_store(activated, g / (lanes_set(1.0f) + lanes_exp(lanes_set(0.0f) - g)));
      lanes_store(target + i, lanes_load(activated) * lanes_load(up + i));
    }
    for (int64_t i = vector_end; i < half; ++i) {
      float g = to_float(gate[i]);
      float activated = to_float(from_float<T>(g / (1.0f + fast_exp(-g))));
      target[i] = from_float<T>(activated * to_float(up[i]));
    }
  }
}

// Rotary embedding in place, NeoX "rotate half" layout: heads [tokens, num_heads, dim] with a
// row stride (query and key heads of a fused qkv row side by side); cos/sin float32
// [positions, dim] tables with both halves equal (as the model keeps them).
template <typename T>
void rotary(T* heads, int64_t row_stride, int64_t tokens, int64_t num_heads, int64_t dim,
            const int64_t* positions, const float* cos_table, const float* sin_table,
            int threads) {
  const int64_t half = dim / 2;
  const int64_t vector_end = half - half % kLanes;
#pragma omp parallel for num_threads(threads_for(tokens * num_heads * dim, threads)) \
    schedule(static)
  for (int64_t token = 0; token < tokens; ++token) {
    const float* cos = cos_table + positions[token] * dim;
    const float* sin = sin_table + positions[token] * dim;
    for (int64_t head = 0; head < num_heads; ++head) {
      T* x = heads + token * row_stride + head * dim;
      for (int64_t i = 0; i < vector_end; i += kLanes) {
        Lanes first = lanes_load(x + i), second = lanes_load(x + i + half);
        lanes_store(x + i, first * lanes_load(cos + i) - second * lanes_load(sin + i));
        lanes_store(x + i + half,
                    fma(second, lanes_load(cos + i + half), first * lanes_load(sin + i + half)));
      }
      for (int64_t i = vector_end; i < half; ++i) {
        float first = to_float(x[i]), second = to_float(x[i + half]);
        x[i] = from_float<T>(first * cos[i] - second * sin[i]);
        x[i + half] = from_float<T>(second * cos[i + half] + first * sin[i + half]);
      }
    }
  }
}

// Copy each token's key and value heads ([tokens, kv_heads * dim] rows with a stride) into
// their cache slots (caches [slots, kv_heads * dim], contiguous).
template <typename T>
void kv_store(const T* key, int64_t key_stride, const T* value, int64_t value_stride,
              T* key_cache, T* value_cache, const int64_t* slots, int64_t tokens, int64_t width) {
  const size_t bytes = static_cast<size_t>(width) * sizeof(T);
  for (int64_t token = 0; token < tokens; ++token) {
    std::memcpy(key_cache + slots[token] * width, key + token * key_stride, bytes);
    std::memcpy(value_cache + slots[token] * width, value + token * value_stride, bytes);
  }
}

// Decode attention. One work item is one (sequence, KV head): the query heads that share the
// KV head (its GQA group, up to kMaxGroupTile at a time) read each key and value row once, from
// the paged cache, in place. Scores come sixteen keys at a time: per key, one partial-product
// vector per query head (an FMA per 16 dims, no horizontal sum), then one transpose-add of the
// sixteen partials gives the sixteen scores (sum_rows16: 45 shuffles and adds for 16 keys, a
// third of a horizontal sum per key). The softmax runs over those score rows in lanes; values
// are weighted with the probabilities broadcast over V rows, accumulators in registers.
// With AVX512-BF16 and a bfloat16 cache, the products are vdpbf16ps on the cached bf16 as it
// lies (32 products an instruction, no conversion): keys against the bf16 query, values
// against pairs of probabilities rounded to bf16 (as the eager path rounds them).
// head_dim that is not a multiple of 16 takes a plain scalar path.
constexpr int64_t kMaxGroupTile = 8;  // query heads per pass over a KV head (accumulators)

inline int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Lane i of the result = the sum of the sixteen lanes of rows[i].
#if defined(__AVX512F__)
inline Lanes sum_rows16(const Lanes* rows) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    const __m512 a = rows[2 * i].v, b = rows[2 * i + 1].v;
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: rows 4i..4i+3 summed over that lane
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {  // then across the four 128-bit lanes, in two steps
    const __m512 a = quads[2 * i], b = quads[2 * i + 1];
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
  }
  return {_mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                        _mm512_shuffle_f32x4(halves[0], halves[1], 0xdd))};
}
#else
inline Lanes sum_rows16(const Lanes* rows) {
  Lanes result;
  for (int64_t i = 0; i < kLanes; ++i) result.v[i] = reduce_add(rows[i]);
  return result;
}
#endif

// scores[0, length) := exp(scale * (score - max)), and 0 on [length, padded); returns the sum.
// padded is a multiple of 16.
inline float exp_scores(float* scores, int64_t length, int64_t padded, float scale) {
  for (int64_t i = length; i < padded; ++i) scores[i] = -std::numeric_limits<float>::infinity();
  Lanes peaks = lanes_set(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < padded; i += kLanes) peaks = lanes_max(peaks, lanes_load(scores + i));
  const Lanes peak = lanes_set(reduce_max(peaks)), factor = lanes_set(scale);
  Lanes totals = lanes_zero();
  for (int64_t i = 0; i < padded; i += kLanes) {
    const Lanes e = lanes_exp((lanes_load(scores + i) - peak) * factor);  // exp(-inf) = 0
    lanes_store(scores + i, e);
    totals = totals + e;
  }
  return reduce_add(totals);
}

// Start loading a cache row's head slice of `dim` elements.
template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < dim * static_cast<int64_t>(sizeof(T)); i += 64) {
    __builtin_prefetch(bytes + i);
  }
}

// How far ahead of the row in use the next rows are prefetched.
constexpr int64_t kPrefetchAhead = 16;

// The rows of the work item a thread does next, prefetched into L2 a few cache lines at a time
// from inside the current item's loops (one burst of prefetches up front would stall the loads
// of the current item behind it): `step` per key handled keeps memory busy while computing.
struct NextRows {
  const char* keys = nullptr;    // the caches, as bytes
  const char* values = nullptr;
  const int32_t* table = nullptr;  // the next sequence's block table
  int64_t block_size = 0, row_bytes = 0, column_bytes = 0, slice_bytes = 0;
  int64_t rows = 0, pos = 0, line = 0;  // rows to prefetch, the cursor (row, byte in the slice)

  void step() {  // two lines of each cache a key (measured: 1 too few, 3-6 no better)
    for (int i = 0; i < 2; ++i) step_line();
  }

  void step_line() {
    if (pos >= rows) return;
    const int64_t block = table[pos / block_size];
    const int64_t offset = (block * block_size + pos % block_size) * row_bytes + column_bytes;
    __builtin_prefetch(keys + offset + line, 0, 2);  // locality 2: into L2 (prefetcht1)
    __builtin_prefetch(values + offset + line, 0, 2);
    line += 64;
    if (line >= slice_bytes) {
      line = 0;
      ++pos;
    }
  }
};

// G query heads over one KV head, head_dim a multiple of 16, float32 products. queries [G, dim]
// float32, already scaled; rows [length]: element offset of each key's head slice in the
// caches; scores: G * round_up(length, 16) floats of scratch; out [G, dim] float32.
template <typename T, int G>
void attend_lanes(const float* queries, const T* key_cache, const T* value_cache,
                  const int64_t* rows, int64_t length, int64_t dim, float* scores, float* out,
                  NextRows& next) {
  const int64_t padded = round_up(length, kLanes);
  Lanes partials[G][kLanes];
  for (int64_t first = 0; first < length; first += kLanes) {
    const int64_t count = length - first < kLanes ? length - first : kLanes;
    for (int64_t j = 0; j < count; ++j) {
      const int64_t pos = first + j;
      if (pos + kPrefetchAhead < length) prefetch_row(key_cache + rows[pos + kPrefetchAhead], dim);
      prefetch_row(value_cache + rows[pos], dim);  // for the weighting below
      next.step();
      const T* key = key_cache + rows[pos];
      Lanes dots[G];
      for (int g = 0; g < G; ++g) dots[g] = lanes_zero();
      for (int64_t c = 0; c < dim; c += kLanes) {
        const Lanes k = lanes_load(key + c);
        for (int g = 0; g < G; ++g) dots[g] = fma(lanes_load(queries + g * dim + c), k, dots[g]);
      }
      for (int g = 0; g < G; ++g) partials[g][j] = dots[g];
    }
    for (int g = 0; g < G; ++g) {
      for (int64_t j = count; j < kLanes; ++j) partials[g][j] = lanes_zero();
      lanes_store(scores + g * padded + first, sum_rows16(partials[g]));
    }
  }
  float inverse[G];
  for (int g = 0; g < G; ++g) {
    inverse[g] = 1.0f / exp_scores(scores + g * padded, length, padded, 1.0f);
  }
  for (int64_t c = 0; c < dim; c += kLanes) {
    Lanes sums[G];
    for (int g = 0; g < G; ++g) sums[g] = lanes_zero();
    for (int64_t pos = 0; pos < length; ++pos) {
      next.step();
      const Lanes v = lanes_load(value_cache + rows[pos] + c);
      for (int g = 0; g < G; ++g) sums[g] = fma(lanes_set(scores[g * padded + pos]), v, sums[g]);
    }
    for (int g = 0; g < G; ++g) lanes_store(out + g * dim + c, sums[g] * lanes_set(inverse[g]));
  }
}

#if defined(__AVX512BF16__)
// The same for a bfloat16 cache with vdpbf16ps. queries [G, padded_dim] bf16 as the model
// made them (unscaled), zero past dim, padded_dim = round_up(dim, 32); probabilities: G *
// round_up(length, 16) bf16 of scratch. A head_dim of 16 mod 32 loads its last 16 dims masked.
template <int G>
void attend_bf16_dot(const bf16* queries, int64_t padded_dim, const bf16* key_cache,
                     const bf16* value_cache, const int64_t* rows, int64_t length, int64_t dim,
                     float scale, float* scores, bf16* probabilities, float* out,
                     NextRows& next) {
  const int64_t padded = round_up(length, kLanes);
  Lanes partials[G][kLanes];
  for (int64_t first = 0; first < length; first += kLanes) {
    const int64_t count = length - first < kLanes ? length - first : kLanes;
    for (int64_t j = 0; j < count; ++j) {
      const int64_t pos = first + j;
      if (pos + kPrefetchAhead < length) prefetch_row(key_cache + rows[pos + kPrefetchAhead], dim);
      prefetch_row(value_cache + rows[pos], dim);
      next.step();
      const bf16* key = key_cache + rows[pos];
      __m512 dots[G];
      for (int g = 0; g < G; ++g) dots[g] = _mm512_setzero_ps();
      for (int64_t c = 0; c < padded_dim; c += 32) {
        const __mmask32 mask = c + 32 <= dim ? 0xffffffffu : 0x0000ffffu;
        const __m512bh k = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, key + c));
        for (int g = 0; g < G; ++g) {
          const __m512i q = _mm512_loadu_si512(queries + g * padded_dim + c);
          dots[g] = _mm512_dpbf16_ps(dots[g], reinterpret_cast<__m512bh>(q), k);
        }
      }
      for (int g = 0; g < G; ++g) partials[g][j] = {dots[g]};
    }
    for (int g = 0; g < G; ++g) {
      for (int64_t j = count; j < kLanes; ++j) partials[g][j] = lanes_zero();
      lanes_store(scores + g * padded + first, sum_rows16(partials[g]));
    }
  }
  float inverse[G];
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * padded;
    inverse[g] = 1.0f / exp_scores(s, length, padded, scale);
    for (int64_t i = 0; i < padded; i += kLanes) {  // round to nearest even, as PyTorch does
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probabilities + g * padded + i),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(s + i))));
    }
  }
  // Two keys at a time: their rows interleaved bf16 by bf16 (unpacklo/hi, within 128-bit
  // lanes), times the pair (p[pos], p[pos + 1]); an odd length pairs its last row with zeros
  // (and probability 0: the padding above). Lane i of `low` holds dim c + 8 (i / 4) + i % 4,
  // of `high` that + 4.
  for (int64_t c = 0; c < padded_dim; c += 32) {
    const __mmask32 mask = c + 32 <= dim ? 0xffffffffu : 0x0000ffffu;
    __m512 low[G], high[G];
    for (int g = 0; g < G; ++g) low[g] = high[g] = _mm512_setzero_ps();
    for (int64_t pos = 0; pos < length; pos += 2) {
      next.step();
      const __m512i a = _mm512_maskz_loadu_epi16(mask, value_cache + rows[pos] + c);
      const __m512i b = pos + 1 < length
                            ? _mm512_maskz_loadu_epi16(mask, value_cache + rows[pos + 1] + c)
                            : _mm512_setzero_si512();
      const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
      const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
      for (int g = 0; g < G; ++g) {
        uint32_t pair;
        std::memcpy(&pair, probabilities + g * padded + pos, sizeof(pair));
        const __m512bh weight = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        low[g] = _mm512_dpbf16_ps(low[g], lo, weight);
        high[g] = _mm512_dpbf16_ps(high[g], hi, weight);
      }
    }
    for (int g = 0; g < G; ++g) {
      float lanes_low[kLanes], lanes_high[kLanes];
      _mm512_storeu_ps(lanes_low, low[g]);
      _mm512_storeu_ps(lanes_high, high[g]);
      for (int64_t i = 0; i < kLanes; ++i) {
        const int64_t d = c + 8 * (i / 4) + i % 4;
        if (d < dim) out[g * dim + d] = lanes_low[i] * inverse[g];
        if (d + 4 < dim) out[g * dim + d + 4] = lanes_high[i] * inverse[g];
      }
    }
  }
}
#endif

// Any head_dim, plainly (models with unusual head sizes). queries [G, dim] float32, scaled.
template <typename T>
void attend_plain(const float* queries, int64_t heads, const T* key_cache, const T* value_cache,
                  const int64_t* rows, int64_t length, int64_t dim, float* scores, float* out) {
  for (int64_t head = 0; head < heads; ++head) {
    const float* q = queries + head * dim;
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t pos = 0; pos < length; ++pos) {
      const T* k = key_cache + rows[pos];
      float dot = 0.0f;
      for (int64_t i = 0; i < dim; ++i) dot += q[i] * to_float(k[i]);
      scores[pos] = dot;
      peak = dot > peak ? dot : peak;
    }
    float total = 0.0f;
    for (int64_t pos = 0; pos < length; ++pos) {
      scores[pos] = fast_exp(scores[pos] - peak);
      total += scores[pos];
    }
    float* o = out + head * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = 0.0f;
    for (int64_t pos = 0; pos < length; ++pos) {
      const T* v = value_cache + rows[pos];
      const float weight = scores[pos] / total;
      for (int64_t i = 0; i < dim; ++i) o[i] += weight * to_float(v[i]);
    }
  }
}

// G query heads (query rows with a head stride) over one KV head's rows; writes out [G, dim].
template <typename T, int G>
void attend_tile(const T* query, int64_t head_stride, const T* key_cache, const T* value_cache,
                 const int64_t* rows, int64_t length, int64_t dim, float scale, T* out,
                 NextRows& next) {
  const int64_t padded = round_up(length, kLanes);
  float* scores = thread_buffer<float>(G * (padded + 2 * dim));
  float* result = scores + G * padded;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    if (dim % kLanes == 0) {
      const int64_t padded_dim = round_up(dim, 32);
      bf16* queries = thread_buffer<bf16>(G * (padded_dim + padded));
      for (int g = 0; g < G; ++g) {
        std::memcpy(queries + g * padded_dim, query + g * head_stride, dim * sizeof(bf16));
        std::memset(queries + g * padded_dim + dim, 0, (padded_dim - dim) * sizeof(bf16));
      }
      attend_bf16_dot<G>(queries, padded_dim, key_cache, value_cache, rows, length, dim, scale,
                         scores, queries + G * padded_dim, result, next);
      for (int64_t i = 0; i < G * dim; ++i) out[i] = from_float<T>(result[i]);
      return;
    }
  }
#endif
  float* queries = result + G * dim;
  for (int g = 0; g < G; ++g) {
    for (int64_t i = 0; i < dim; ++i) {
      queries[g * dim + i] = to_float(query[g * head_stride + i]) * scale;
    }
  }
  if (dim % kLanes == 0) {
    attend_lanes<T, G>(queries, key_cache, value_cache, rows, length, dim, scores, result, next);
  } else {
    attend_plain<T>(queries, G, key_cache, value_cache, rows, length, dim, scores, result);
  }
  for (int64_t i = 0; i < G * dim; ++i) out[i] = from_float<T>(result[i]);
}

// One query token per sequence over its paged KV cache. query [batch, heads, dim] with a row
// and head stride; caches [slots, kv_heads, dim]; block_tables [batch, table_stride] int32;
// seq_lens [batch] (keys per sequence, the new token's included); out [batch, heads, dim].
//
// A work item is a sequence, all its KV heads (each cache row, all heads, lies contiguous: one
// stream of whole blocks), or with fewer sequences than twice the threads a (sequence, KV head).
// The kernel is bound by memory, not arithmetic: every step reads every cached row once and
// none of it is in cache (the layers in between stream the weights). So items are claimed one
// ahead, and while a thread computes one item the rows of its next one are prefetched into L2
// (into the L2 of the thread that will use them, which OpenMP's dynamic schedule cannot know).
template <typename T>
void decode_attention(const T* query, int64_t query_stride, int64_t query_head_stride,
                      const T* key_cache, const T* value_cache, const int32_t* block_tables,
                      int64_t table_stride, const int32_t* seq_lens, T* out, int64_t batch,
                      int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                      float scale, int threads) {
  const int64_t group = heads / kv_heads, width = kv_heads * dim;
  int64_t total_keys = 0;
  for (int64_t b = 0; b < batch; ++b) total_keys += seq_lens[b];
  const int used = threads_for(total_keys * heads * dim / 8, threads);
  const int64_t parts = batch >= 2 * used ? 1 : kv_heads;  // KV heads split per sequence
  const int64_t heads_per_part = kv_heads / parts, items = batch * parts;
  // Element offset of a sequence's row `pos` (its first KV head) in the caches.
  auto row_of = [&](int64_t b, int64_t pos) {
    const int64_t block = block_tables[b * table_stride + pos / block_size];
    return (block * block_size + pos % block_size) * width;
  };
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(used)
  {
    int64_t item = claimed.fetch_add(1);
    while (item < items) {
      const int64_t next_item = claimed.fetch_add(1);
      NextRows upcoming;
      if (next_item < items) {
        const int64_t b = next_item / parts;
        upcoming = {reinterpret_cast<const char*>(key_cache),
                    reinterpret_cast<const char*>(value_cache),
                    block_tables + b * table_stride,
                    block_size,
                    width * static_cast<int64_t>(sizeof(T)),
                    next_item % parts * heads_per_part * dim * static_cast<int64_t>(sizeof(T)),
                    heads_per_part * dim * static_cast<int64_t>(sizeof(T))};
        upcoming.rows = seq_lens[b];
      }
      const int64_t b = item / parts, length = seq_lens[b];
      int64_t* rows = thread_buffer<int64_t>(length);
      for (int64_t pos = 0; pos < length; ++pos) rows[pos] = row_of(b, pos);
      const int64_t first_kv = item % parts * heads_per_part;
      for (int64_t kv_head = first_kv; kv_head < first_kv + heads_per_part; ++kv_head) {
        if (kv_head > first_kv) {
          for (int64_t pos = 0; pos < length; ++pos) rows[pos] += dim;
        } else if (kv_head > 0) {
          for (int64_t pos = 0; pos < length; ++pos) rows[pos] += kv_head * dim;
        }
        for (int64_t first = 0; first < group; first += kMaxGroupTile) {
          const int64_t head = kv_head * group + first;
          const T* q = query + b * query_stride + head * query_head_stride;
          T* target = out + (b * heads + head) * dim;
          switch (group - first < kMaxGroupTile ? group - first : kMaxGroupTile) {
#define SLUICE_TILE(G)                                                                          \
  case G:                                                                                       \
    attend_tile<T, G>(q, query_head_stride, key_cache, value_cache, rows, length, dim, scale, \
                      target, upcoming);                                                        \
    break;
            SLUICE_TILE(1)
            SLUICE_TILE(2)
            SLUICE_TILE(3)
            SLUICE_TILE(4)
            SLUICE_TILE(5)
            SLUICE_TILE(6)
            SLUICE_TILE(7)
            SLUICE_TILE(8)
#undef SLUICE_TILE
          }
        }
      }
      item = next_item;
    }
  }
}

// Prefill attention: each sequence's chunk of query tokens, causally, over its paged cache (the
// chunk's own keys and values already stored there, so a first prefill, a chunk after a cached
// prefix and a prefix-cache hit are one case). Query token i of a chunk sits at position
// prefix + i (prefix = keys cached before the chunk) and sees keys [0, prefix + i].
//
// A work item is (sequence, KV head, tile of kPrefillQueries query tokens): its rows are the
// tile's tokens times the GQA group's query heads, and every row takes each tile of kKeyTile
// keys from the same packed copy (loaded from the cache once per item). Flash-style: per row, a
// running max and sum, and its float32 output rescaled whenever the max grows, so no scores
// beyond one key tile are kept. Items go longest first to OpenMP's dynamic schedule.
//
// Products: with AVX512-BF16 and a bfloat16 cache, vdpbf16ps (two products a lane): the key
// tile packed as [dim / 2][kKeyTile] pairs of dims (the scores of 16 keys in one register, the
// query's pair broadcast), the value tile as [kKeyTile / 2][dim] pairs of keys (16 dims in one
// register, a pair of probabilities broadcast, rounded to bf16 as the eager path rounds them).
// Otherwise the same in float32 FMAs ([dim][kKeyTile] keys, [kKeyTile][dim] values). A head_dim
// that is not a multiple of 16 runs each query token as a plain decode (attend_plain).
constexpr int64_t kPrefillQueries = 32;  // query tokens per work item
constexpr int64_t kKeyTile = 32;         // keys per tile: two registers of scores
constexpr int64_t kRowBlock = 4;         // rows through a tile together (bf16 products)

// One row's softmax over a tile: scores [kKeyTile] raw dot products, the first `visible` valid.
// Updates the row's running max (of scaled scores) and sum; leaves exp(scale * score - max) in
// scores (0 past visible) and returns the factor for the row's earlier output.
inline float online_softmax(float* scores, int64_t visible, float scale, float& peak,
                            float& total) {
  for (int64_t k = visible; k < kKeyTile; ++k) scores[k] = -std::numeric_limits<float>::infinity();
  const Lanes factor = lanes_set(scale);
  Lanes low = lanes_load(scores) * factor, high = lanes_load(scores + kLanes) * factor;
  const float tile_peak = reduce_max(lanes_max(low, high));
  const float new_peak = tile_peak > peak ? tile_peak : peak;
  const float rescale = fast_exp(peak - new_peak);  // 0 for the first tile (peak = -inf)
  const Lanes shift = lanes_set(new_peak);
  low = lanes_exp(low - shift);
  high = lanes_exp(high - shift);
  lanes_store(scores, low);
  lanes_store(scores + kLanes, high);
  total = total * rescale + reduce_add(low + high);
  peak = new_peak;
  return rescale;
}

// One row's float32 products: scores [kKeyTile] of q [dim] against keys packed [dim][kKeyTile].
inline void tile_scores(const float* q, const float* keys, int64_t dim, float* scores) {
  Lanes acc[2][2] = {{lanes_zero(), lanes_zero()}, {lanes_zero(), lanes_zero()}};
  for (int64_t d = 0; d < dim; d += 2) {
    for (int u = 0; u < 2; ++u) {
      const Lanes q_d = lanes_set(q[d + u]);
      const float* k = keys + (d + u) * kKeyTile;
      acc[0][u] = fma(q_d, lanes_load(k), acc[0][u]);
      acc[1][u] = fma(q_d, lanes_load(k + kLanes), acc[1][u]);
    }
  }
  lanes_store(scores, acc[0][0] + acc[0][1]);
  lanes_store(scores + kLanes, acc[1][0] + acc[1][1]);
}

// out[0, 16 N) = out * rescale + the first `visible` probabilities times value rows [.][dim].
template <int N>
inline void tile_values(const float* probs, int64_t visible, const float* values, int64_t dim,
                        float rescale, float* out) {
  Lanes acc[2][N];
  for (int u = 0; u < N; ++u) acc[0][u] = acc[1][u] = lanes_zero();
  int64_t k = 0;
  for (; k + 1 < visible; k += 2) {
    for (int t = 0; t < 2; ++t) {
      const Lanes p = lanes_set(probs[k + t]);
      for (int u = 0; u < N; ++u) {
        acc[t][u] = fma(p, lanes_load(values + (k + t) * dim + u * kLanes), acc[t][u]);
      }
    }
  }
  if (k < visible) {
    const Lanes p = lanes_set(probs[k]);
    for (int u = 0; u < N; ++u) {
      acc[0][u] = fma(p, lanes_load(values + k * dim + u * kLanes), acc[0][u]);
    }
  }
  const Lanes factor = lanes_set(rescale);
  for (int u = 0; u < N; ++u) {
    float* o = out + u * kLanes;
    lanes_store(o, fma(lanes_load(o), factor, acc[0][u] + acc[1][u]));
  }
}

#if defined(__AVX512BF16__)
// The same with vdpbf16ps for R rows at once (the rows' chains interleave; each key register
// loaded once for all R): q_pairs [R][dim / 2] (two bf16 each), keys packed [dim / 2][kKeyTile];
// scores [R][kKeyTile].
template <int R>
inline void tile_scores_bf16(const uint32_t* q_pairs, const uint32_t* keys, int64_t dim,
                             float* scores) {
  const int64_t half = dim / 2;
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < half; ++c) {
    const __m512bh low = (__m512bh)_mm512_loadu_si512(keys + c * kKeyTile);
    const __m512bh high = (__m512bh)_mm512_loadu_si512(keys + c * kKeyTile + kLanes);
    for (int i = 0; i < R; ++i) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[i * half + c]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], low, q);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], high, q);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(scores + i * kKeyTile, acc[i][0]);
    _mm512_storeu_ps(scores + i * kKeyTile + kLanes, acc[i][1]);
  }
}

// out[i][0, 16 N) = out[i] * rescale[i] + row i's probabilities times the value tile's dims
// [0, 16 N): prob_pairs [R][kKeyTile / 2] (two bf16 each, the first `pairs` used), values
// packed [kKeyTile / 2][dim] pairs of keys; out rows `dim` apart.
template <int R, int N>
inline void tile_values_bf16(const uint32_t* prob_pairs, int64_t pairs, const uint32_t* values,
                             int64_t dim, const float* rescale, float* out) {
  __m512 acc[R][N];
  for (int i = 0; i < R; ++i) {
    for (int u = 0; u < N; ++u) acc[i][u] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh v[N];
    for (int u = 0; u < N; ++u) v[u] = (__m512bh)_mm512_loadu_si512(values + j * dim + u * kLanes);
    for (int i = 0; i < R; ++i) {
      const int p_bits = static_cast<int>(prob_pairs[i * (kKeyTile / 2) + j]);
      const __m512bh p = (__m512bh)_mm512_set1_epi32(p_bits);
      for (int u = 0; u < N; ++u) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], v[u], p);
    }
  }
  for (int i = 0; i < R; ++i) {
    const __m512 factor = _mm512_set1_ps(rescale[i]);
    for (int u = 0; u < N; ++u) {
      float* o = out + i * dim + u * kLanes;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), factor, acc[i][u]));
    }
  }
}

// Transposes a 16 x 16 block of 32-bit elements in place: rows[i] lane j <-> rows[j] lane i.
inline void transpose16(__m512i* rows) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane L: rows i, i + 1 at columns 4L..4L+3
    a[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int m = 0; m < 16; m += 4) {  // b[m + t] lane L: column 4L + t of rows m..m+3
    b[m] = _mm512_unpacklo_epi64(a[m], a[m + 2]);
    b[m + 1] = _mm512_unpackhi_epi64(a[m], a[m + 2]);
    b[m + 2] = _mm512_unpacklo_epi64(a[m + 1], a[m + 3]);
    b[m + 3] = _mm512_unpackhi_epi64(a[m + 1], a[m + 3]);
  }
  for (int t = 0; t < 4; ++t) {  // column 4L + t: lane L of b[t], b[4 + t], b[8 + t], b[12 + t]
    const __m512i low01 = _mm512_shuffle_i32x4(b[t], b[4 + t], 0x44);
    const __m512i low23 = _mm512_shuffle_i32x4(b[8 + t], b[12 + t], 0x44);
    const __m512i high01 = _mm512_shuffle_i32x4(b[t], b[4 + t], 0xee);
    const __m512i high23 = _mm512_shuffle_i32x4(b[8 + t], b[12 + t], 0xee);
    rows[t] = _mm512_shuffle_i32x4(low01, low23, 0x88);
    rows[4 + t] = _mm512_shuffle_i32x4(low01, low23, 0xdd);
    rows[8 + t] = _mm512_shuffle_i32x4(high01, high23, 0x88);
    rows[12 + t] = _mm512_shuffle_i32x4(high01, high23, 0xdd);
  }
}

// R rows (consecutive, each seeing at least one key of the tile) through one key tile.
template <int R>
inline void tile_rows_bf16(const uint32_t* q_pairs, const uint32_t* keys, const uint32_t* values,
                           int64_t dim, const int64_t* visible, float scale, float* peaks,
                           float* totals, float* outputs, float* scores, uint32_t* prob_pairs) {
  tile_scores_bf16<R>(q_pairs, keys, dim, scores);
  float rescale[R];
  int64_t most = 0;
  for (int i = 0; i < R; ++i) {
    float* row = scores + i * kKeyTile;
    rescale[i] = online_softmax(row, visible[i], scale, peaks[i], totals[i]);
    for (int64_t k = 0; k < kKeyTile; k += kLanes) {  // round to nearest even, as PyTorch does
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prob_pairs + i * (kKeyTile / 2) + k / 2),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + k)));
    }
    most = visible[i] > most ? visible[i] : most;
  }
  over_dim_chunks(dim, [&](int64_t d, auto n) {
    tile_values_bf16<R, decltype(n)::value>(prob_pairs, (most + 1) / 2, values + d, dim, rescale,
                                            outputs + d);
  });
}
#endif

// Per-row accumulate for a whole head_dim, 64 dims (four registers) at a time.
template <typename F>
inline void over_dim_chunks(int64_t dim, F&& chunk) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= dim; d += 4 * kLanes) chunk(d, std::integral_constant<int, 4>{});
  switch ((dim - d) / kLanes) {
    case 3: chunk(d, std::integral_constant<int, 3>{}); break;
    case 2: chunk(d, std::integral_constant<int, 2>{}); break;
    case 1: chunk(d, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// Where a prefill work item's rows live and go.
struct PrefillItem {
  int64_t seq, kv_head, first;  // first: the tile's first query token within the chunk
  int64_t cost;                 // rows x keys, to order the items
};

template <typename T>
void prefill_attention(const T* query, int64_t query_stride, int64_t query_head_stride,
                       const T* key_cache, const T* value_cache, const int32_t* block_tables,
                       int64_t table_stride, const int32_t* query_starts,
                       const int32_t* seq_lens, T* out, int64_t out_stride, int64_t num_seqs,
                       int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                       float scale, int threads) {
  const int64_t group = heads / kv_heads, width = kv_heads * dim;
  std::vector<PrefillItem> items;
  int64_t work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t length = query_starts[s + 1] - query_starts[s];
    const int64_t prefix = seq_lens[s] - length;
    for (int64_t first = 0; first < length; first += kPrefillQueries) {
      const int64_t count = std::min(kPrefillQueries, length - first);
      const int64_t cost = count * (prefix + first + count);
      work += cost * kv_heads;
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({s, h, first, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const PrefillItem& a, const PrefillItem& b) { return a.cost > b.cost; });
  const int used = threads_for(work * heads / kv_heads * dim / 8, threads);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const bool lanes_path = dim % kLanes == 0;
#if defined(__AVX512BF16__)
  constexpr bool kBf16Dot = std::is_same_v<T, bf16>;
#else
  constexpr bool kBf16Dot = false;
#endif

#pragma omp parallel for num_threads(used) schedule(dynamic, 1)
  for (int64_t index = 0; index < num_items; ++index) {
    const PrefillItem item = items[index];
    const int64_t start = query_starts[item.seq] + item.first;
    const int64_t length = query_starts[item.seq + 1] - query_starts[item.seq];
    const int64_t prefix = seq_lens[item.seq] - length;
    const int64_t count = std::min(kPrefillQueries, length - item.first);
    const int64_t key_end = prefix + item.first + count;  // keys the tile's last token sees
    const int64_t rows_total = count * group;              // row r: token r / group, head r % group
    const int32_t* table = block_tables + item.seq * table_stride;
    int64_t* rows = thread_buffer<int64_t>(key_end);
    for (int64_t pos = 0; pos < key_end; ++pos) {
      rows[pos] = (table[pos / block_size] * block_size + pos % block_size) * width +
                  item.kv_head * dim;
    }
    auto query_row = [&](int64_t r) {
      return query + (start + r / group) * query_stride +
             (item.kv_head * group + r % group) * query_head_stride;
    };
    auto out_row = [&](int64_t r) {
      return out + (start + r / group) * out_stride + (item.kv_head * group + r % group) * dim;
    };

    if (!lanes_path) {  // any head_dim: each token as a decode of its visible keys
      float* scratch = thread_buffer<float>(key_end + 2 * group * dim);
      float* queries = scratch + key_end;
      float* result = queries + group * dim;
      for (int64_t token = 0; token < count; ++token) {
        for (int64_t g = 0; g < group; ++g) {
          const T* q = query_row(token * group + g);
          for (int64_t i = 0; i < dim; ++i) queries[g * dim + i] = to_float(q[i]) * scale;
        }
        const int64_t visible = prefix + item.first + token + 1;
        attend_plain<T>(queries, group, key_cache, value_cache, rows, visible, dim, scratch,
                        result);
        for (int64_t g = 0; g < group; ++g) {
          T* o = out_row(token * group + g);
          for (int64_t i = 0; i < dim; ++i) o[i] = from_float<T>(result[g * dim + i]);
        }
      }
      continue;
    }

    // Per-thread scratch: outputs [rows][dim], running max and sum [rows], one row's scores,
    // and the packed tiles (float32, or pairs of bf16 as uint32).
    float* outputs = thread_buffer<float>(rows_total * (dim + 2) + kRowBlock * kKeyTile +
                                          (kBf16Dot ? 0 : rows_total * dim + 2 * kKeyTile * dim));
    float* peaks = outputs + rows_total * dim;
    float* totals = peaks + rows_total;
    float* scores = totals + rows_total;
    for (int64_t i = 0; i < rows_total * dim; ++i) outputs[i] = 0.0f;
    for (int64_t r = 0; r < rows_total; ++r) {
      peaks[r] = -std::numeric_limits<float>::infinity();
      totals[r] = 0.0f;
    }
#if defined(__AVX512BF16__)
    if constexpr (kBf16Dot) {
      const int64_t half = dim / 2;
      uint32_t* q_pairs = thread_buffer<uint32_t>(rows_total * half + 2 * kKeyTile * half +
                                                  kRowBlock * kKeyTile / 2);
      uint32_t* keys = q_pairs + rows_total * half;
      uint32_t* values = keys + kKeyTile * half;
      uint32_t* prob_pairs = values + kKeyTile * half;
      for (int64_t r = 0; r < rows_total; ++r) {
        std::memcpy(q_pairs + r * half, query_row(r), dim * sizeof(bf16));
      }
      for (int64_t first_key = 0; first_key < key_end; first_key += kKeyTile) {
        const int64_t tile = std::min(kKeyTile, key_end - first_key);
        // keys [half][kKeyTile]: 16 keys x 16 pairs at a time, transposed in registers; zeros
        // past the tile.
        for (int64_t k = 0; k < kKeyTile; k += kLanes) {
          for (int64_t c = 0; c < half; c += kLanes) {
            const int64_t columns = std::min(kLanes, half - c);
            const __mmask16 mask = static_cast<__mmask16>((1u << columns) - 1u);
            __m512i block[kLanes];
            for (int64_t i = 0; i < kLanes; ++i) {
              block[i] = k + i < tile ? _mm512_maskz_loadu_epi32(
                                            mask, key_cache + rows[first_key + k + i] + 2 * c)
                                      : _mm512_setzero_si512();
            }
            transpose16(block);
            for (int64_t j = 0; j < columns; ++j) {
              _mm512_storeu_si512(keys + (c + j) * kKeyTile + k, block[j]);
            }
          }
        }
        for (int64_t j = 0; j < kKeyTile / 2; ++j) {  // values [kKeyTile / 2][dim] key pairs
          const int64_t k = 2 * j;
          auto widen = [&](int64_t key, int64_t d) {  // 16 bf16 as the low halves of uint32
            if (key >= tile) return _mm512_setzero_si512();
            const bf16* row = value_cache + rows[first_key + key] + d;
            return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
          };
          for (int64_t d = 0; d < dim; d += kLanes) {
            const __m512i second = _mm512_slli_epi32(widen(k + 1, d), 16);
            _mm512_storeu_si512(values + j * dim + d, _mm512_or_si512(widen(k, d), second));
          }
        }
        // Rows before `first_row` see no key of this tile (causal); the rest in blocks.
        const int64_t first_row = std::max<int64_t>(0, first_key - prefix - item.first) * group;
        for (int64_t r = first_row; r < rows_total; r += kRowBlock) {
          const int64_t block = std::min(kRowBlock, rows_total - r);
          int64_t visible[kRowBlock];
          for (int64_t i = 0; i < block; ++i) {
            visible[i] = std::min(tile, prefix + item.first + (r + i) / group - first_key + 1);
          }
          switch (block) {
#define SLUICE_ROWS(R)                                                                           \
  case R:                                                                                        \
    tile_rows_bf16<R>(q_pairs + r * half, keys, values, dim, visible, scale, peaks + r,           \
                      totals + r, outputs + r * dim, scores, prob_pairs);                         \
    break;
            SLUICE_ROWS(1)
            SLUICE_ROWS(2)
            SLUICE_ROWS(3)
            SLUICE_ROWS(4)
#undef SLUICE_ROWS
          }
        }
      }
    } else
#endif
    {
      float* queries = scores + kRowBlock * kKeyTile;
      float* keys = queries + rows_total * dim;
      float* values = keys + kKeyTile * dim;
      for (int64_t r = 0; r < rows_total; ++r) {
        const T* q = query_row(r);
        for (int64_t i = 0; i < dim; ++i) queries[r * dim + i] = to_float(q[i]);
      }
      for (int64_t first_key = 0; first_key < key_end; first_key += kKeyTile) {
        const int64_t tile = std::min(kKeyTile, key_end - first_key);
        for (int64_t k = 0; k < kKeyTile; ++k) {  // keys [dim][kKeyTile], values [kKeyTile][dim]
          if (k < tile) {
            const T* key = key_cache + rows[first_key + k];
            const T* value = value_cache + rows[first_key + k];
            for (int64_t d = 0; d < dim; ++d) keys[d * kKeyTile + k] = to_float(key[d]);
            for (int64_t d = 0; d < dim; ++d) values[k * dim + d] = to_float(value[d]);
          } else {
            for (int64_t d = 0; d < dim; ++d) keys[d * kKeyTile + k] = 0.0f;
          }
        }
        for (int64_t r = 0; r < rows_total; ++r) {
          const int64_t visible = std::min(tile, prefix + item.first + r / group - first_key + 1);
          if (visible <= 0) continue;
          tile_scores(queries + r * dim, keys, dim, scores);
          const float rescale = online_softmax(scores, visible, scale, peaks[r], totals[r]);
          over_dim_chunks(dim, [&](int64_t d, auto n) {
            tile_values<decltype(n)::value>(scores, visible, values + d, dim, rescale,
                                            outputs + r * dim + d);
          });
        }
      }
    }
    for (int64_t r = 0; r < rows_total; ++r) {
      const float inverse = 1.0f / totals[r];
      T* o = out_row(r);
      for (int64_t i = 0; i < dim; ++i) o[i] = from_float<T>(outputs[r * dim + i] * inverse);
    }
  }
}

// A projection's LoRA deltas added to its output in place, for every adapter row of a step
// in one call (the CPU path's per-segment matmuls cost more in dispatch than in arithmetic):
// for listed row r on slot s, per slice i of the projection, u = x[r] . A[s, i, :k]^T in
// float32 (k = ranks[s]; 0: the slot leaves this projection alone), then
// y[r, cols of slice i] += u . B[s, cols, :k]^T, each output rounded once to T (as eager
// PyTorch adds a float32 delta to a T tensor). x and y rows have their own strides; A is
// float32 [slots, slices, max_rank, in] and B is given transposed, float32
// [slots, max_rank, out], contiguous: the expand runs along contiguous output columns.
template <typename T>
void lora_delta(const T* x, int64_t x_stride, T* y, int64_t y_stride, const int32_t* rows,
                const int32_t* row_slots, int64_t count, const float* a, const float* bt,
                const int32_t* ranks, const int64_t* slice_offsets, int64_t slices,
                int64_t max_rank, int64_t in, int64_t out, int threads) {
#pragma omp parallel num_threads(threads_for(count * (in * slices + out) * max_rank, threads))
  {
    float* row = thread_buffer<float>(in + slices * max_rank + out);  // x's row, u, the delta
    float* u = row + in;
    float* delta = u + slices * max_rank;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < count; ++n) {
      const int64_t slot = row_slots[n];
      const int64_t rank = ranks[slot];
      if (rank <= 0) continue;
      const T* source = x + rows[n] * x_stride;
      for (int64_t k = 0; k < in; ++k) row[k] = to_float(source[k]);
      const float* a_slot = a + slot * slices * max_rank * in;
      for (int64_t i = 0; i < slices; ++i) {
        for (int64_t j = 0; j < rank; ++j) {
          const float* a_row = a_slot + (i * max_rank + j) * in;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < in; ++k) acc += row[k] * a_row[k];
          u[i * max_rank + j] = acc;
        }
      }
      T* target = y + rows[n] * y_stride;
      const float* bt_slot = bt + slot * max_rank * out;
      for (int64_t i = 0; i < slices; ++i) {
        const int64_t low = slice_offsets[i], high = slice_offsets[i + 1];
        for (int64_t col = low; col < high; ++col) delta[col] = 0.0f;
        for (int64_t j = 0; j < rank; ++j) {
          const float weight = u[i * max_rank + j];
          const float* bt_row = bt_slot + j * out;
#pragma omp simd
          for (int64_t col = low; col < high; ++col) delta[col] += weight * bt_row[col];
        }
        for (int64_t col = low; col < high; ++col) {
          target[col] = from_float<T>(to_float(target[col]) + delta[col]);
        }
      }
    }
  }
}

// Index of each row's largest value (the first one on ties, as torch.argmax); rows [rows,
// width] with a row stride. NaN never wins (logits are finite).
template <typename T>
void argmax_rows(const T* values, int64_t row_stride, int64_t rows, int64_t width,
                 int64_t* result, int threads) {
  constexpr int64_t kChunk = 512;
#pragma omp parallel for num_threads(threads_for(rows * width, threads)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = values + r * row_stride;
    float best = -std::numeric_limits<float>::infinity();
    int64_t best_chunk = 0;
    for (int64_t start = 0; start < width; start += kChunk) {
      const int64_t end = start + kChunk < width ? start + kChunk : width;
      float peak = -std::numeric_limits<float>::infinity();
      int64_t i = start;
      if (end - start >= kLanes) {
        Lanes peaks = lanes_set(peak);
        for (; i + kLanes <= end; i += kLanes) peaks = lanes_max(peaks, lanes_load(row + i));
        peak = reduce_max(peaks);
      }
      for (; i < end; ++i) peak = to_float(row[i]) > peak ? to_float(row[i]) : peak;
      if (peak > best) {
        best = peak;
        best_chunk = start;
      }
    }
    int64_t index = best_chunk;
    const int64_t end = best_chunk + kChunk < width ? best_chunk + kChunk : width;
    for (int64_t i = best_chunk; i < end; ++i) {
      if (to_float(row[i]) == best) {
        index = i;
        break;
      }
    }
    result[r] = index;
  }
}


// The LM head of bfloat16 models (AVX-512 BF16 builds), with float32 logits: the products are
// never rounded to bf16, so two tokens whose logits differ only past bf16's 8 bits of mantissa
// do not tie (rounded, such near-ties flip greedy answers of small models). lm_head_bf16 writes
// the [rows, vocab] float32 logits; greedy_head_bf16 gives each row's argmax without writing
// them (for a small hidden size writing and re-reading the logits costs more than the products:
// dummy:tiny, 64 rows x 49,152 x 16). The weight is packed once (cpu_native.py:
// pack_greedy_head) into tiles of 16 vocabulary rows holding pairs of hidden elements,
// [tiles][dim / 2][16][2] (dim padded to even with zeros), so one vdpbf16ps adds two products
// to 16 rows' scores. Eight rows at a time keep their scores (and best scores and ids) in
// registers while a chunk of tiles (L2-resident) streams by. Both run the same products in the
// same order, so the greedy answer is exactly the argmax of lm_head_bf16's logits; ties go to
// the lowest id (as torch.argmax). `has_greedy_head` tells the caller whether the build has them.
constexpr int64_t kHeadRows = 8;
// Tiles per chunk: every block of rows re-reads a chunk, so it should stay in L2 (~512 KB of
// packed weights: 1024 tiles of dummy:tiny's head, 28 of SmolLM2's, 4 of a 4096-wide head).
constexpr int64_t kHeadChunkBytes = 512 * 1024;
inline int64_t head_chunk_tiles(int64_t pairs) {
  const int64_t tiles = kHeadChunkBytes / (pairs * 64);
  return tiles > 1 ? tiles : 1;
}

#if defined(__AVX512BF16__)
constexpr bool kHasGreedyHead = true;

// Rows [kHeadRows][pairs] (uint32 = two bf16) against tiles [first, last) of the packed head.
// kLogits: store each row's float32 scores to logits (rows `vocab` apart, the first `count`
// rows only); else keep each row's running best score and id per lane in best/best_id.
template <bool kLogits>
inline void head_rows(const uint32_t* rows, int64_t pairs, const bf16* packed, int64_t first,
                      int64_t last, int64_t vocab, int64_t count, float* best, int32_t* best_id,
                      float* logits) {
  __m512 peak[kHeadRows];
  __m512i id[kHeadRows];
  if constexpr (!kLogits) {
#pragma GCC unroll 8
    for (int64_t r = 0; r < kHeadRows; ++r) {
      peak[r] = _mm512_loadu_ps(best + r * 16);
      id[r] = _mm512_loadu_si512(best_id + r * 16);
    }
  }
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t tile = first; tile < last; ++tile) {
    __m512 acc[kHeadRows];
#pragma GCC unroll 8
    for (int64_t r = 0; r < kHeadRows; ++r) acc[r] = _mm512_setzero_ps();
    const bf16* w = packed + tile * pairs * 32;
    for (int64_t k = 0; k < pairs; ++k) {
      const __m512bh weights = (__m512bh)_mm512_loadu_si512(w + k * 32);
#pragma GCC unroll 8
      for (int64_t r = 0; r < kHeadRows; ++r) {
        const __m512bh h = (__m512bh)_mm512_set1_epi32(static_cast<int>(rows[r * pairs + k]));
        acc[r] = _mm512_dpbf16_ps(acc[r], h, weights);
      }
    }
    const int64_t valid = vocab - tile * 16;
    const __mmask16 in_vocab =
        valid >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << valid) - 1u);
    if constexpr (kLogits) {
      for (int64_t r = 0; r < count; ++r)
        _mm512_mask_storeu_ps(logits + r * vocab + tile * 16, in_vocab, acc[r]);
    } else {
      const __m512i ids = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(tile * 16)));
#pragma GCC unroll 8
      for (int64_t r = 0; r < kHeadRows; ++r) {
        const __mmask16 better = _mm512_mask_cmp_ps_mask(in_vocab, acc[r], peak[r], _CMP_GT_OQ);
        peak[r] = _mm512_mask_mov_ps(peak[r], better, acc[r]);
        id[r] = _mm512_mask_mov_epi32(id[r], better, ids);
      }
    }
  }
  if constexpr (!kLogits) {
#pragma GCC unroll 8
    for (int64_t r = 0; r < kHeadRows; ++r) {
      _mm512_storeu_ps(best + r * 16, peak[r]);
      _mm512_storeu_si512(best_id + r * 16, id[r]);
    }
  }
}

// The rows as bf16 pairs, zero-padded to whole pairs and to whole blocks of kHeadRows rows.
inline std::vector<uint32_t> head_row_pairs(const bf16* hidden, int64_t hidden_stride,
                                            int64_t rows, int64_t dim) {
  const int64_t pairs = (dim + 1) / 2;
  const int64_t blocks = (rows + kHeadRows - 1) / kHeadRows;
  std::vector<uint32_t> row_pairs(static_cast<size_t>(blocks * kHeadRows * pairs), 0u);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(row_pairs.data() + r * pairs, hidden + r * hidden_stride, dim * sizeof(bf16));
  return row_pairs;
}

// The walk both heads share: the rows as pairs, the vocabulary's tiles split over the threads,
// each thread's tiles in L2-sized chunks, and every block of kHeadRows rows through each chunk.
struct HeadWalk {
  std::vector<uint32_t> row_pairs;
  int64_t pairs, blocks, tiles;
  int used;  // threads

  HeadWalk(const bf16* hidden, int64_t hidden_stride, int64_t rows, int64_t dim, int64_t vocab,
           int threads)
      : row_pairs(head_row_pairs(hidden, hidden_stride, rows, dim)),
        pairs((dim + 1) / 2),
        blocks((rows + kHeadRows - 1) / kHeadRows),
        tiles((vocab + 15) / 16) {
    used = threads_for(rows * vocab * dim / 4, threads);
    used = used < tiles ? used : static_cast<int>(tiles);
  }

  // visit(thread, first tile, end tile, block) for every chunk of every thread's tiles.
  template <typename F>
  void run(F&& visit) const {
#pragma omp parallel num_threads(used)
    {
      const int me = omp_get_thread_num();
      const int64_t first = tiles * me / used, last = tiles * (me + 1) / used;
      const int64_t step = head_chunk_tiles(pairs);
      for (int64_t chunk = first; chunk < last; chunk += step) {
        const int64_t end = chunk + step < last ? chunk + step : last;
        for (int64_t block = 0; block < blocks; ++block) visit(me, chunk, end, block);
      }
    }
  }
};

// Float32 logits [rows, vocab] of the packed bf16 head: the same products, in the same order, as
// greedy_head_bf16 compares, so its argmax is exactly greedy_head_bf16's answer.
void lm_head_bf16(const bf16* hidden, int64_t hidden_stride, int64_t rows, int64_t dim,
                  const bf16* packed, int64_t vocab, float* logits, int threads) {
  const HeadWalk walk(hidden, hidden_stride, rows, dim, vocab, threads);
  walk.run([&](int, int64_t chunk, int64_t end, int64_t block) {
    const int64_t row0 = block * kHeadRows;
    const int64_t count = rows - row0 < kHeadRows ? rows - row0 : kHeadRows;
    head_rows<true>(walk.row_pairs.data() + row0 * walk.pairs, walk.pairs, packed, chunk, end,
                    vocab, count, nullptr, nullptr, logits + row0 * vocab);
  });
}

void greedy_head_bf16(const bf16* hidden, int64_t hidden_stride, int64_t rows, int64_t dim,
                      const bf16* packed, int64_t vocab, int64_t* result, int threads) {
  const HeadWalk walk(hidden, hidden_stride, rows, dim, vocab, threads);
  const int64_t blocks = walk.blocks;
  const int used = walk.used;
  // Per thread, padded row and lane: best score and its id over that thread's tiles.
  const size_t slots = static_cast<size_t>(used * blocks * kHeadRows * 16);
  std::vector<float> best(slots, -std::numeric_limits<float>::infinity());
  std::vector<int32_t> best_id(slots, 0);
  walk.run([&](int me, int64_t chunk, int64_t end, int64_t block) {
    const size_t at = static_cast<size_t>((me * blocks + block) * kHeadRows * 16);
    head_rows<false>(walk.row_pairs.data() + block * kHeadRows * walk.pairs, walk.pairs, packed,
                     chunk, end, vocab, kHeadRows, best.data() + at, best_id.data() + at,
                     nullptr);
  });
  // Merge lanes and threads: the largest score, the lowest id among equal ones.
  for (int64_t r = 0; r < rows; ++r) {
    float peak = -std::numeric_limits<float>::infinity();
    int64_t id = -1;
    for (int t = 0; t < used; ++t) {
      const size_t base = static_cast<size_t>((t * blocks * kHeadRows + r) * 16);
      for (int64_t lane = 0; lane < 16; ++lane) {
        const float value = best[base + lane];
        const int64_t candidate = best_id[base + lane];
        if (value == -std::numeric_limits<float>::infinity()) continue;  // lane never valid
        if (id < 0 || value > peak || (value == peak && candidate < id)) {
          peak = value;
          id = candidate;
        }
      }
    }
    result[r] = id < 0 ? 0 : id;
  }
}
#else
constexpr bool kHasGreedyHead = false;
void greedy_head_bf16(const bf16*, int64_t, int64_t, int64_t, const bf16*, int64_t, int64_t*,
                      int) {}
void lm_head_bf16(const bf16*, int64_t, int64_t, int64_t, const bf16*, int64_t, float*, int) {}
#endif

}  // namespace

// C entry points: one per kernel and dtype (suffix _f32 / _bf16), pointers as void*.
#define SLUICE_EXPORT extern "C" __attribute__((visibility("default")))

#define SLUICE_DEFINE(SUFFIX, T)                                                              \
  SLUICE_EXPORT void sluice_rms_norm_##SUFFIX(const void* x, int64_t x_stride,                \
                                              const void* residual, const void* weight,       \
                                              void* out, void* residual_out, int64_t rows,    \
                                              int64_t dim, float eps, int threads) {          \
    rms_norm<T>(static_cast<const T*>(x), x_stride, static_cast<const T*>(residual),         \
                static_cast<const T*>(weight), static_cast<T*>(out),                          \
                static_cast<T*>(residual_out), rows, dim, eps, threads);                      \
  }                                                                                           \
  SLUICE_EXPORT void sluice_silu_mul_##SUFFIX(const void* gate_up, void* out, int64_t rows,   \
                                              int64_t half, int threads) {                    \
    silu_mul<T>(static_cast<const T*>(gate_up), static_cast<T*>(out), rows, half, threads);   \
  }                                                                                           \
  SLUICE_EXPORT void sluice_rotary_##SUFFIX(void* heads, int64_t row_stride, int64_t tokens,  \
                                            int64_t num_heads, int64_t dim,                   \
                                            const int64_t* positions, const float* cos_table, \
                                            const float* sin_table, int threads) {            \
    rotary<T>(static_cast<T*>(heads), row_stride, tokens, num_heads, dim, positions,          \
              cos_table, sin_table, threads);                                                 \
  }                                                                                           \
  SLUICE_EXPORT void sluice_kv_store_##SUFFIX(                                                \
      const void* key, int64_t key_stride, const void* value, int64_t value_stride,           \
      void* key_cache, void* value_cache, const int64_t* slots, int64_t tokens,               \
      int64_t width) {                                                                        \
    kv_store<T>(static_cast<const T*>(key), key_stride, static_cast<const T*>(value),         \
                value_stride, static_cast<T*>(key_cache), static_cast<T*>(value_cache), slots, \
                tokens, width);                                                               \
  }                                                                                           \
  SLUICE_EXPORT void sluice_decode_attention_##SUFFIX(                                        \
      const void* query, int64_t query_stride, int64_t query_head_stride,                     \
      const void* key_cache, const void* value_cache, const int32_t* block_tables,            \
      int64_t table_stride, const int32_t* seq_lens, void* out, int64_t batch, int64_t heads, \
      int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int threads) {          \
    decode_attention<T>(static_cast<const T*>(query), query_stride, query_head_stride,        \
                        static_cast<const T*>(key_cache), static_cast<const T*>(value_cache), \
                        block_tables, table_stride, seq_lens, static_cast<T*>(out), batch,    \
                        heads, kv_heads, dim, block_size, scale, threads);                    \
  }                                                                                           \
  SLUICE_EXPORT void sluice_prefill_attention_##SUFFIX(                                       \
      const void* query, int64_t query_stride, int64_t query_head_stride, const void* key_cache, \
      const void* value_cache, const int32_t* block_tables, int64_t table_stride,               \
      const int32_t* query_starts, const int32_t* seq_lens, void* out, int64_t out_stride,      \
      int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,       \
      float scale, int threads) {                                                               \
    prefill_attention<T>(static_cast<const T*>(query), query_stride, query_head_stride,         \
                         static_cast<const T*>(key_cache), static_cast<const T*>(value_cache),  \
                         block_tables, table_stride, query_starts, seq_lens,                    \
                         static_cast<T*>(out), out_stride, num_seqs, heads, kv_heads, dim,      \
                         block_size, scale, threads);                                           \
  }                                                                                             \
  SLUICE_EXPORT void sluice_lora_delta_##SUFFIX(                                              \
      const void* x, int64_t x_stride, void* y, int64_t y_stride, const int32_t* rows,          \
      const int32_t* row_slots, int64_t count, const float* a, const float* bt,                 \
      const int32_t* ranks, const int64_t* slice_offsets, int64_t slices, int64_t max_rank,     \
      int64_t in, int64_t out, int threads) {                                                   \
    lora_delta<T>(static_cast<const T*>(x), x_stride, static_cast<T*>(y), y_stride, rows,       \
                  row_slots, count, a, bt, ranks, slice_offsets, slices, max_rank, in, out,     \
                  threads);                                                                     \
  }                                                                                             \
  SLUICE_EXPORT void sluice_argmax_rows_##SUFFIX(const void* values, int64_t row_stride,      \
                                                 int64_t rows, int64_t width,                 \
                                                 int64_t* result, int threads) {              \
    argmax_rows<T>(static_cast<const T*>(values), row_stride, rows, width, result, threads);  \
  }

SLUICE_DEFINE(f32, float)
SLUICE_DEFINE(bf16, bf16)

// Whether greedy_head_bf16 exists in this build (AVX-512 BF16); without it the caller keeps
// the unfused head.
SLUICE_EXPORT int sluice_has_greedy_head() { return kHasGreedyHead ? 1 : 0; }

SLUICE_EXPORT void sluice_greedy_head_bf16(const void* hidden, int64_t hidden_stride, int64_t rows,
                                           int64_t dim, const void* packed, int64_t vocab,
                                           int64_t* result, int threads) {
  greedy_head_bf16(static_cast<const bf16*>(hidden), hidden_stride, rows, dim,
                   static_cast<const bf16*>(packed), vocab, result, threads);
}

SLUICE_EXPORT void sluice_lm_head_bf16(const void* hidden, int64_t hidden_stride, int64_t rows,
                                       int64_t dim, const void* packed, int64_t vocab,
                                       float* logits, int threads) {
  lm_head_bf16(static_cast<const bf16*>(hidden), hidden_stride, rows, dim,
               static_cast<const bf16*>(packed), vocab, logits, threads);
}

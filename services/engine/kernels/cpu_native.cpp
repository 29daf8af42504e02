// Native CPU kernels of the torch backend's CPU path (see cpu_native.py, which compiles this
// file once per machine and calls it through ctypes with tensor data pointers).
//
// Each kernel fuses what PyTorch eager runs as several small ops (each a dispatch, an
// allocation and a pass over memory): residual add + RMSNorm, silu(gate) * up, rotary
// embedding in place, the paged KV-cache write, decode attention straight from the paged cache
// (no gather copy, no padding to the longest sequence), and a row-wise argmax. Every kernel
// computes in float32 and exists for float32 and bfloat16 tensors (bfloat16 is stored as its
// upper 16 bits and rounded to nearest even, as PyTorch does). Threads: OpenMP with the count
// the caller passes (PyTorch's own thread count), inside PyTorch's OpenMP runtime.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

// Scratch rows of float32 per thread, reused across calls.
inline float* scratch(int64_t size) {
  thread_local std::vector<float> buffer;
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
    float* summed = scratch(dim);
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

// Decode attention of one sequence, all its heads, for head_dim = kChunks * 16. The sequence's
// cache blocks are read once, whole ([block_size, kv_heads * dim] each, contiguous: streaming
// reads the prefetchers follow), into float32 scratch rows; the products run from there with
// the accumulators in registers. queries: [heads, dim] float32, already scaled; out [heads,
// dim]; scratch: 2 * length * kv_heads * dim + length floats.
template <typename T, int kChunks>
void attend_fixed(const float* queries, const T* key_cache, const T* value_cache,
                  const int32_t* table, int64_t length, int64_t kv_heads, int64_t group,
                  int64_t block_size, float* scratch_rows, float* out) {
  constexpr int64_t dim = kChunks * kLanes;
  const int64_t width = kv_heads * dim;
  float* keys = scratch_rows;
  float* values = keys + length * width;
  float* s = values + length * width;
  for (int64_t first = 0; first < length; first += block_size) {
    const int64_t rows = first + block_size < length ? block_size : length - first;
    const int64_t offset = static_cast<int64_t>(table[first / block_size]) * block_size * width;
    if (first + block_size < length) {  // the next block: start its loads early
      const int64_t next = static_cast<int64_t>(table[first / block_size + 1]) * block_size;
      __builtin_prefetch(key_cache + next * width);
      __builtin_prefetch(value_cache + next * width);
    }
    for (int64_t i = 0; i < rows * width; i += kLanes) {
      lanes_store(keys + first * width + i, lanes_load(key_cache + offset + i));
      lanes_store(values + first * width + i, lanes_load(value_cache + offset + i));
    }
  }
  for (int64_t head = 0; head < kv_heads * group; ++head) {
    const int64_t column = (head / group) * dim;
    Lanes query[kChunks];
    for (int c = 0; c < kChunks; ++c) query[c] = lanes_load(queries + head * dim + c * kLanes);
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t pos = 0; pos < length; ++pos) {
      const float* k = keys + pos * width + column;
      Lanes partial = query[0] * lanes_load(k);
      for (int c = 1; c < kChunks; ++c) partial = fma(query[c], lanes_load(k + c * kLanes), partial);
      s[pos] = reduce_add(partial);
      peak = s[pos] > peak ? s[pos] : peak;
    }
    float total = 0.0f;
    int64_t pos = 0;
    if (length >= kLanes) {
      Lanes totals = lanes_zero();
      for (; pos + kLanes <= length; pos += kLanes) {
        const Lanes e = lanes_exp(lanes_load(s + pos) - lanes_set(peak));
        lanes_store(s + pos, e);
        totals = totals + e;
      }
      total = reduce_add(totals);
    }
    for (; pos < length; ++pos) {
      s[pos] = fast_exp(s[pos] - peak);
      total += s[pos];
    }
    Lanes accum[kChunks];
    for (int c = 0; c < kChunks; ++c) accum[c] = lanes_zero();
    for (pos = 0; pos < length; ++pos) {
      const Lanes weight = lanes_set(s[pos]);
      const float* v = values + pos * width + column;
      for (int c = 0; c < kChunks; ++c) accum[c] = fma(weight, lanes_load(v + c * kLanes), accum[c]);
    }
    const Lanes inverse = lanes_set(1.0f / total);
    for (int c = 0; c < kChunks; ++c) {
      lanes_store(out + head * dim + c * kLanes, accum[c] * inverse);
    }
  }
}

// The same for any head_dim, plainly, straight from the cache (models with unusual head sizes).
template <typename T>
void attend_generic(const float* queries, const T* key_cache, const T* value_cache,
                    const int32_t* table, int64_t length, int64_t kv_heads, int64_t group,
                    int64_t dim, int64_t block_size, float* s, float* out) {
  for (int64_t head = 0; head < kv_heads * group; ++head) {
    const int64_t kv_head = head / group;
    const float* q = queries + head * dim;
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t pos = 0; pos < length; ++pos) {
      const int64_t slot =
          static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
      const T* k = key_cache + (slot * kv_heads + kv_head) * dim;
      float dot = 0.0f;
      for (int64_t i = 0; i < dim; ++i) dot += q[i] * to_float(k[i]);
      s[pos] = dot;
      peak = dot > peak ? dot : peak;
    }
    float total = 0.0f;
    for (int64_t pos = 0; pos < length; ++pos) {
      s[pos] = fast_exp(s[pos] - peak);
      total += s[pos];
    }
    float* o = out + head * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = 0.0f;
    for (int64_t pos = 0; pos < length; ++pos) {
      const int64_t slot =
          static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
      const T* v = value_cache + (slot * kv_heads + kv_head) * dim;
      const float weight = s[pos] / total;
      for (int64_t i = 0; i < dim; ++i) o[i] += weight * to_float(v[i]);
    }
  }
}

// One query token per sequence over its paged KV cache. query [batch, heads, dim] with a row
// and head stride; caches [slots, kv_heads, dim]; block_tables [batch, table_stride] int32;
// seq_lens [batch] (keys per sequence, the new token's included); out [batch, heads, dim].
// Work items are sequences; scores are computed for all keys, then softmaxed, then the values
// are weighted (keys and values each read once).
template <typename T>
void decode_attention(const T* query, int64_t query_stride, int64_t query_head_stride,
                      const T* key_cache, const T* value_cache, const int32_t* block_tables,
                      int64_t table_stride, const int32_t* seq_lens, T* out, int64_t batch,
                      int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                      float scale, int threads) {
  const int64_t group = heads / kv_heads;
  int64_t total_keys = 0;
  for (int64_t b = 0; b < batch; ++b) total_keys += seq_lens[b];
#pragma omp parallel for num_threads(threads_for(total_keys * heads * dim / 8, threads)) \
    schedule(dynamic, 1)
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = seq_lens[b];
    float* queries = scratch(heads * dim * 2 + (2 * kv_heads * dim + 1) * length);
    float* result = queries + heads * dim;
    float* rest = result + heads * dim;
    for (int64_t head = 0; head < heads; ++head) {
      const T* q = query + b * query_stride + head * query_head_stride;
      for (int64_t i = 0; i < dim; ++i) queries[head * dim + i] = to_float(q[i]) * scale;
    }
    const int32_t* table = block_tables + b * table_stride;
    if (dim == 64) {
      attend_fixed<T, 4>(queries, key_cache, value_cache, table, length, kv_heads, group,
                         block_size, rest, result);
    } else if (dim == 128) {
      attend_fixed<T, 8>(queries, key_cache, value_cache, table, length, kv_heads, group,
                         block_size, rest, result);
    } else {
      attend_generic<T>(queries, key_cache, value_cache, table, length, kv_heads, group, dim,
                        block_size, rest, result);
    }
    T* target = out + b * heads * dim;
    for (int64_t i = 0; i < heads * dim; ++i) target[i] = from_float<T>(result[i]);
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


// Greedy LM head for bfloat16 (AVX-512 BF16 builds): each row's argmax over the vocabulary of
// hidden . weight[v] without writing the [rows, vocab] logits. For a small hidden size writing
// and re-reading those logits costs more than the products (dummy:tiny: 64 rows x 49,152 x 16).
// The weight is packed once (cpu_native.py: pack_greedy_head) into tiles of 16 vocabulary rows
// holding pairs of hidden elements, [tiles][dim / 2][16][2] (dim padded to even with zeros),
// so one vdpbf16ps adds two products to 16 rows' scores. Eight rows at a time keep their
// scores, best scores and best ids in registers while a chunk of tiles (L2-resident) streams
// by. Scores are rounded to bfloat16 before they are compared, as the logits of the unfused
// head are, and ties go to the lowest id (as torch.argmax). `has_greedy_head` tells the
// caller whether this build has it.
constexpr int64_t kHeadRows = 8;
constexpr int64_t kHeadChunkTiles = 128;  // 128 tiles x dim/2 x 64 bytes: L2 for dim <= 128

#if defined(__AVX512BF16__)
constexpr bool kHasGreedyHead = true;

inline __m512 round_to_bf16(__m512 value) {
  __m512i bits = _mm512_castps_si512(value);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(~0xffff)));
}

// Rows [kHeadRows][pairs] (uint32 = two bf16) against tiles [first, last); best/ids in and out.
inline void head_rows(const uint32_t* rows, int64_t pairs, const bf16* packed, int64_t first,
                      int64_t last, int64_t vocab, float* best, int32_t* best_id) {
  __m512 peak[kHeadRows];
  __m512i id[kHeadRows];
#pragma GCC unroll 8
  for (int64_t r = 0; r < kHeadRows; ++r) {
    peak[r] = _mm512_loadu_ps(best + r * 16);
    id[r] = _mm512_loadu_si512(best_id + r * 16);
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
    const __m512i ids = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(tile * 16)));
    const int64_t valid = vocab - tile * 16;
    const __mmask16 in_vocab =
        valid >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << valid) - 1u);
#pragma GCC unroll 8
    for (int64_t r = 0; r < kHeadRows; ++r) {
      const __m512 score = round_to_bf16(acc[r]);
      const __mmask16 better = _mm512_mask_cmp_ps_mask(in_vocab, score, peak[r], _CMP_GT_OQ);
      peak[r] = _mm512_mask_mov_ps(peak[r], better, score);
      id[r] = _mm512_mask_mov_epi32(id[r], better, ids);
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < kHeadRows; ++r) {
    _mm512_storeu_ps(best + r * 16, peak[r]);
    _mm512_storeu_si512(best_id + r * 16, id[r]);
  }
}

void greedy_head_bf16(const bf16* hidden, int64_t hidden_stride, int64_t rows, int64_t dim,
                      const bf16* packed, int64_t vocab, int64_t* result, int threads) {
  const int64_t pairs = (dim + 1) / 2;
  const int64_t blocks = (rows + kHeadRows - 1) / kHeadRows;
  // Rows as bf16 pairs, zero-padded to whole pairs and to whole blocks of kHeadRows rows.
  std::vector<uint32_t> row_pairs(static_cast<size_t>(blocks * kHeadRows * pairs), 0u);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(row_pairs.data() + r * pairs, hidden + r * hidden_stride, dim * sizeof(bf16));
  const int64_t tiles = (vocab + 15) / 16;
  int used = threads_for(rows * vocab * dim / 4, threads);
  used = used < tiles ? used : static_cast<int>(tiles);
  // Per thread, padded row and lane: best score and its id over that thread's tiles.
  const size_t slots = static_cast<size_t>(used * blocks * kHeadRows * 16);
  std::vector<float> best(slots, -std::numeric_limits<float>::infinity());
  std::vector<int32_t> best_id(slots, 0);
#pragma omp parallel num_threads(used)
  {
    const int me = omp_get_thread_num();
    const int64_t first = tiles * me / used, last = tiles * (me + 1) / used;
    const size_t mine = static_cast<size_t>(me * blocks * kHeadRows * 16);
    for (int64_t chunk = first; chunk < last; chunk += kHeadChunkTiles) {
      const int64_t end = chunk + kHeadChunkTiles < last ? chunk + kHeadChunkTiles : last;
      for (int64_t block = 0; block < blocks; ++block) {
        const size_t at = mine + static_cast<size_t>(block * kHeadRows * 16);
        head_rows(row_pairs.data() + block * kHeadRows * pairs, pairs, packed, chunk, end, vocab,
                  best.data() + at, best_id.data() + at);
      }
    }
  }
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

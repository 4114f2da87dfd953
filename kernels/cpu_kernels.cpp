// Compiled CPU kernels of the native engine (built once per machine by cpu_extension.py).
//
// The operations, each with a torch reference that is its fallback and its test oracle
// (and, further down, the quantized linear, the whole decoder forward and the decoder
// layer's elementwise regions):
//
//   packed_linear    x [M, K] @ W^T with W packed once as [ceil(N / 16), K, 16]: each
//                    16-column block is one contiguous stream, read once per call for all
//                    rows (decode is a weight stream at memory speed; prefill reuses each
//                    block from the L2 cache for every 8 rows). fp32 accumulation.
//   store_kv         a step's K/V into the CPU cache layout below.
//   paged_attention  every query row against its own K/V (causal) and its shared prefix
//                    segments (non-causal), read in place from the paged cache, merged by
//                    log-sum-exp in the same call (BatchLLM's shared-prefix attention).
//
// CPU cache layout (one layer; a token's slot is block * block_size + offset):
//   k_cache [num_kv_heads, num_blocks, head_dim, block_size]   K transposed per block, so
//           16 keys of one dimension are one vector (scores for 16 keys = FMAs, no shuffles)
//   v_cache [num_kv_heads, num_blocks, block_size, head_dim]
// KV head first: one head's consecutive blocks are one contiguous stream for the prefetchers.
//
// Plain C++ loops over 16 lanes with `omp simd`: the compiler (-O3 -march=native) turns them
// into AVX-512 or AVX2 code. Floats are fp32 or bf16 (raw uint16 bits); arithmetic is fp32.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int LANES = 16;  // one 512-bit vector of fp32
// Rows of x (linear) or query vectors (attention) sharing one weight or key load: their
// accumulators must fit the vector registers (32 with AVX-512; 16 with AVX2, where a
// 16-lane vector takes two: 6 rows are 12 accumulators, with the two weight halves and the
// broadcast 15). The fastest tiles measured.
#if defined(__AVX512F__)
constexpr int LINEAR_TILE = 8;
constexpr int TILE_QUERIES = 8;
#else
constexpr int LINEAR_TILE = 6;
constexpr int TILE_QUERIES = 4;
#endif
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

using bf16_bits = uint16_t;
// small helpers called inside vectorized loops: inlined, or the loops stay scalar
#define ALWAYS_INLINE inline __attribute__((always_inline))

// run(std::integral_constant<int, rows>{}): one template instance per tile size 1..MAX
template <int MAX, typename F>
ALWAYS_INLINE void with_rows(int rows, F&& run) {
  static_assert(MAX <= 8, "with_rows: tiles of up to 8 rows");
  switch (rows) {
#define TILE_CASE(n) \
  case n:            \
    if constexpr (n <= MAX) return run(std::integral_constant<int, n>{}); \
    break;
    TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7)
    TILE_CASE(8)
#undef TILE_CASE
  }
  TORCH_CHECK(false, "a tile of ", rows, " rows, not 1..", MAX);
}

template <typename T>  // T: [const] float (dtype checked) or bf16_bits
T* data_of(const at::Tensor& t) {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>)
    return t.data_ptr<float>();
  else
    return reinterpret_cast<T*>(t.data_ptr());
}

// run(static_cast<T*>(nullptr)) for t's dtype T: float or bf16_bits; else the error message
template <typename F, typename... Message>
void dispatch_dtype(const at::Tensor& t, F&& run, const Message&... message) {
  if (t.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, message...);
    run(static_cast<bf16_bits*>(nullptr));
  }
}

ALWAYS_INLINE float load_float(const float* p) { return *p; }
ALWAYS_INLINE float load_float(const bf16_bits* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

ALWAYS_INLINE void store_float(float* p, float value) { *p = value; }
ALWAYS_INLINE void store_float(bf16_bits* p, float value) {
  // round to nearest even, as torch converts (NaN stays NaN)
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *p = 0x7fc0;
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *p = static_cast<bf16_bits>(bits >> 16);
}

// Cephes' expf reduction and polynomial, branch-free so that loops over it vectorize (about
// 1 ulp): exp(clamped - n ln 2), n = round(clamped / ln 2).
ALWAYS_INLINE float exp_reduced(float clamped, float n) {
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x): 0 below -87 (and for -inf), +inf above 88.5.
ALWAYS_INLINE float exp_any(float x) {
  const float clamped = std::min(std::max(x, -87.0f), 88.5f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float p = exp_reduced(clamped, n);
  // 2^n in two factors, so n up to 128 (x near 88.7) does not overflow the exponent field
  const int32_t half = static_cast<int32_t>(n) >> 1;
  const int32_t first = (half + 127) << 23, second = (static_cast<int32_t>(n) - half + 127) << 23;
  float scale1, scale2;
  std::memcpy(&scale1, &first, sizeof(scale1));
  std::memcpy(&scale2, &second, sizeof(scale2));
  const float value = p * scale1 * scale2;
  return x < -87.0f ? 0.0f : (x > 88.5f ? std::numeric_limits<float>::infinity() : value);
}

// exp(x) for x <= 0 (softmax weights): as exp_any, one scale factor. 0 below -87.
ALWAYS_INLINE float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float p = exp_reduced(clamped, n);
  const int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// 16 fp32 lanes as a GCC vector (one zmm register with AVX-512), which keeps accumulators in
// registers. Without AVX-512 it is lowered through the stack, every operation a copy: there
// the hot tiles below take two __m256 per 16 lanes instead (Lanes).
typedef float vec16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t vec16_u16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vec16_u32 __attribute__((vector_size(64), aligned(4)));

ALWAYS_INLINE vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
ALWAYS_INLINE vec16 load16(const bf16_bits* p) {
  vec16_u16 half;
  std::memcpy(&half, p, sizeof(half));
  const vec16_u32 bits = __builtin_convertvector(half, vec16_u32) << 16;
  vec16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
ALWAYS_INLINE void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// Lanes: the 16 fp32 lanes of the hot tiles' accumulators; lanes_fma(s, v, acc) = acc + s * v
// with one rounding.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
ALWAYS_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
ALWAYS_INLINE __m256 load8(const bf16_bits* p) {  // 8 bf16 widened to fp32
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
struct Lanes {
  __m256 lo, hi;
};
ALWAYS_INLINE Lanes lanes_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
template <typename T>
ALWAYS_INLINE Lanes lanes_load(const T* p) {
  return {load8(p), load8(p + 8)};
}
ALWAYS_INLINE Lanes lanes_fma(float s, Lanes v, Lanes acc) {
  const __m256 b = _mm256_set1_ps(s);
  return {_mm256_fmadd_ps(b, v.lo, acc.lo), _mm256_fmadd_ps(b, v.hi, acc.hi)};
}
ALWAYS_INLINE Lanes lanes_scale(Lanes v, float s) {
  const __m256 b = _mm256_set1_ps(s);
  return {_mm256_mul_ps(v.lo, b), _mm256_mul_ps(v.hi, b)};
}
ALWAYS_INLINE void lanes_store(float* p, Lanes v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
#define UNROLL_PAIRS _Pragma("GCC unroll 16")  // each row's two FMAs, unrolled over the rows

// exp_nonpositive on 8 lanes: the same reduction and polynomial (GCC leaves the scalar
// loops over it unvectorized on AVX2, where they took half of the attention's time).
ALWAYS_INLINE __m256 exp_nonpositive8(__m256 x) {
  const __m256 clamped = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i exponent =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 value = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), value);
}
#define HAVE_EXP8 1

// exp_any on 8 lanes with exp_any's operations, each rounded (called where fp-contract is
// off, as the scalar one there: the same values lane for lane)
ALWAYS_INLINE __m256 exp_any8(__m256 x) {
  const __m256 clamped =
      _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.5f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  auto mul = [](__m256 a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); };
  auto add = [](__m256 a, float b) { return _mm256_add_ps(a, _mm256_set1_ps(b)); };
  __m256 r = _mm256_sub_ps(clamped, mul(n, 0.693359375f));
  r = _mm256_sub_ps(r, mul(n, -2.12194440e-4f));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = add(_mm256_mul_ps(p, r), 1.3981999507e-3f);
  p = add(_mm256_mul_ps(p, r), 8.3334519073e-3f);
  p = add(_mm256_mul_ps(p, r), 4.1665795894e-2f);
  p = add(_mm256_mul_ps(p, r), 1.6666665459e-1f);
  p = add(_mm256_mul_ps(p, r), 5.0000001201e-1f);
  p = add(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), 1.0f);
  const __m256i whole = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(whole, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 second = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(whole, half), bias), 23));
  const __m256 value = _mm256_mul_ps(_mm256_mul_ps(p, first), second);
  const __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  const __m256 high = _mm256_cmp_ps(x, _mm256_set1_ps(88.5f), _CMP_GT_OQ);
  return _mm256_blendv_ps(_mm256_andnot_ps(low, value),
                          _mm256_set1_ps(std::numeric_limits<float>::infinity()), high);
}
#else
using Lanes = vec16;
ALWAYS_INLINE Lanes lanes_zero() { return vec16{}; }
template <typename T>
ALWAYS_INLINE Lanes lanes_load(const T* p) {
  return load16(p);
}
ALWAYS_INLINE Lanes lanes_fma(float s, Lanes v, Lanes acc) { return acc + s * v; }
ALWAYS_INLINE Lanes lanes_scale(Lanes v, float s) { return v * s; }
ALWAYS_INLINE void lanes_store(float* p, Lanes v) { store16(p, v); }
#define UNROLL_PAIRS
#endif

// ------------------------------------------------------------------ packed linear

// out[m][n0 + j] = sum_k x[m][k] * w[k][j] (+ bias[n0 + j]) for one 16-column block
// w [K][16], M rows of x and the block's first `width` columns.
// Bytes ahead of the weight stream a tile prefetches when its rows make as much arithmetic as
// memory traffic (fewer rows are memory-bound and run faster without it).
constexpr int64_t PREFETCH_BYTES = 4096;

// Not inlined: in the caller its accumulators were spilled (AVX2 has 16 vector registers).
template <int M, typename W, typename T>
__attribute__((noinline)) void linear_block(const float* __restrict x, int64_t K,
                                            const W* __restrict w, const float* bias, int64_t n0,
                                            int width, T* __restrict out, int64_t N,
                                            bool prefetch) {
  Lanes sums[M];
  for (int m = 0; m < M; ++m) sums[m] = lanes_zero();
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch) __builtin_prefetch(reinterpret_cast<const char*>(w + k * LANES) + PREFETCH_BYTES);
    const Lanes weights = lanes_load(w + k * LANES);
    UNROLL_PAIRS
    for (int m = 0; m < M; ++m) sums[m] = lanes_fma(x[m * K + k], weights, sums[m]);
  }
  for (int m = 0; m < M; ++m) {
    float row[LANES];
    lanes_store(row, sums[m]);
    T* dst = out + m * N + n0;
    for (int j = 0; j < width; ++j) store_float(dst + j, bias ? row[j] + bias[n0 + j] : row[j]);
  }
}

// bf16 weights on CPUs with AVX512-BF16: packed as pairs of consecutive k,
// [blocks][ceil(K / 2)][16][2], so one VDPBF16PS multiplies 16 columns by two k at once
// (twice the work of an fp32 FMA per instruction; fp32 accumulation). Elsewhere bf16
// weights keep the [blocks][K][16] layout and are widened to fp32 as they load.
#if defined(__AVX512BF16__)
constexpr bool BF16_PAIRS = true;

// as above, for M rows of bf16 pairs x [M][pairs]
template <int M>
__attribute__((noinline)) void linear_block(const uint32_t* __restrict x, int64_t pairs,
                                            const uint32_t* __restrict w, const float* bias,
                                            int64_t n0, int width, bf16_bits* __restrict out,
                                            int64_t N, bool prefetch) {
  __m512 sums[M];
  for (int m = 0; m < M; ++m) sums[m] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    if (prefetch) __builtin_prefetch(reinterpret_cast<const char*>(w + p * LANES) + PREFETCH_BYTES);
    const __m512bh weights = (__m512bh)_mm512_loadu_si512(w + p * LANES);
    for (int m = 0; m < M; ++m)
      sums[m] = _mm512_dpbf16_ps(sums[m], (__m512bh)_mm512_set1_epi32(x[m * pairs + p]), weights);
  }
  for (int m = 0; m < M; ++m) {
    float row[LANES];
    _mm512_storeu_ps(row, sums[m]);
    bf16_bits* dst = out + m * N + n0;
    for (int j = 0; j < width; ++j) store_float(dst + j, bias ? row[j] + bias[n0 + j] : row[j]);
  }
}
#else
constexpr bool BF16_PAIRS = false;
#endif

// x [M, K] @ W^T: each task takes whole 16-column blocks of packed [blocks][K][16]; a
// block's weights are read once from memory and reused from cache by every tile of rows.
// X, W: fp32 rows and fp32 or bf16 weights, or (AVX512-BF16) bf16 pairs of k for both.
template <typename X, typename W, typename T>
void packed_linear_impl(const X* x, int64_t M, int64_t K, const W* packed, int64_t blocks,
                        const float* bias, T* out, int64_t N) {
  const int64_t block_bytes = K * LANES * static_cast<int64_t>(sizeof(W));
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, block_bytes * M));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const W* w = packed + block * K * LANES;
      const int64_t n0 = block * LANES;
      const int width = static_cast<int>(std::min<int64_t>(LANES, N - n0));
      for (int64_t m0 = 0; m0 < M; m0 += LINEAR_TILE) {
        const int rows = static_cast<int>(std::min<int64_t>(LINEAR_TILE, M - m0));
        with_rows<LINEAR_TILE>(rows, [&](auto R) {
          linear_block<R>(x + m0 * K, K, w, bias, n0, width, out + m0 * N, N,
                          m0 == 0 && M >= TILE_QUERIES);
        });
      }
    }
  });
}

// ------------------------------------------------------------------ quantized linear

// Weights quantized in groups of 32 along k (a GGUF file's Q4_0, Q4_1, Q4_K, Q5_0, Q5_1 and
// Q8_0 blocks as they are, other types and float weights quantized to 8 bits at load):
// w[n][k] = scale[n][g] * q[n][k] + min[n][g], q unsigned (4 or 8 bits), scale and min fp16.
// Packed as uint8 [ceil(N / 16)][K / 32][group bytes]: per 16-column block and group, the
// quants, then the 16 columns' fp16 scales, then their fp16 mins.
//   4 bits (256 + 64 bytes): chunk c (0..3), byte 4j + b = q[j][8c + b] | q[j][8c + 4 + b] << 4
//   8 bits (512 + 64 bytes): chunk r (0..7), byte 4j + b = q[j][4r + b]
// Each row of x is quantized per group to int8: x ~ d * qa, qa = round(x * 127 / max|x|),
// and s = d * sum(qa). Then y[m][n] = sum over groups of
//   (scale[n][g] * d[m][g]) * dot(q[n], qa[m]) + min[n][g] * s[m][g]
// in fp32, groups in order: a row's output does not depend on the other rows (invariant).
constexpr int QGROUP = 32;
constexpr int64_t Q4_GROUP_BYTES = 256 + 64, Q8_GROUP_BYTES = 512 + 64;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int QUANT_TILE = 2;  // rows per weight load (4 bits; 8 bits take 2 of them at a time)
#else
constexpr int QUANT_TILE = 1;
#endif

bool is_quantized(const at::Tensor& packed) { return packed.scalar_type() == at::kByte; }
int64_t quant_bits(const at::Tensor& packed) {
  return packed.size(2) == Q4_GROUP_BYTES ? 4 : 8;
}

// x [M][K] quantized per row and group of 32 (above): qa [M][K], d and s [M][K / 32]
struct QuantizedRows {
  std::vector<int8_t> qa;
  std::vector<float> d, s;
};

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, QuantizedRows& rows) {
  const int64_t groups = K / QGROUP;
  rows.qa.resize(M * K);
  rows.d.resize(M * groups);
  rows.s.resize(M * groups);
  at::parallel_for(0, M * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* src = x + i * QGROUP;  // row i / groups, group i % groups: x is contiguous
      float v[QGROUP], amax = 0.0f;
      for (int k = 0; k < QGROUP; ++k) {
        v[k] = load_float(src + k);
        amax = std::max(amax, std::fabs(v[k]));
      }
      const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* q = rows.qa.data() + i * QGROUP;
      int32_t sum = 0;
      for (int k = 0; k < QGROUP; ++k) {
        q[k] = static_cast<int8_t>(std::nearbyint(v[k] * inverse));
        sum += q[k];
      }
      rows.d[i] = amax / 127.0f;
      rows.s[i] = rows.d[i] * static_cast<float>(sum);
    }
  });
}

ALWAYS_INLINE float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// the 4 bytes of chunk `c` for column j, k offset b, unpacked: q[j][k] of the group
template <int BITS>
ALWAYS_INLINE int32_t group_dot(const uint8_t* quants, int j, const int8_t* qa) {
  int32_t sum = 0;
  if constexpr (BITS == 4) {
    for (int c = 0; c < 4; ++c)
      for (int b = 0; b < 4; ++b) {
        const uint8_t byte = quants[64 * c + 4 * j + b];
        sum += (byte & 15) * qa[8 * c + b] + (byte >> 4) * qa[8 * c + 4 + b];
      }
  } else {
    for (int r = 0; r < 8; ++r)
      for (int b = 0; b < 4; ++b) sum += quants[64 * r + 4 * j + b] * qa[4 * r + b];
  }
  return sum;
}

// out[m][n0 + j] for one 16-column block and M rows (the reference arithmetic above; the
// AVX2 tile below computes the same integer dots and the same fp32 operations in order)
template <int BITS, typename T>
void quant_block_scalar(const QuantizedRows& rows, int64_t m0, int M, int64_t K,
                        const uint8_t* w, const float* bias, int64_t n0, int width, T* out,
                        int64_t N) {
  const int64_t groups = K / QGROUP, group_bytes = BITS == 4 ? Q4_GROUP_BYTES : Q8_GROUP_BYTES;
  const int quant_bytes = BITS == 4 ? 256 : 512;
  for (int m = 0; m < M; ++m) {
    const int64_t row = m0 + m;
    for (int j = 0; j < width; ++j) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* base = w + g * group_bytes;
        const int32_t dot = group_dot<BITS>(base, j, rows.qa.data() + row * K + g * QGROUP);
        const float scale = half_to_float(base + quant_bytes + 2 * j);
        const float minimum = half_to_float(base + quant_bytes + 32 + 2 * j);
        acc = std::fma(scale * rows.d[row * groups + g], static_cast<float>(dot), acc);
        acc = std::fma(minimum, rows.s[row * groups + g], acc);
      }
      store_float(out + row * N + n0 + j, bias ? acc + bias[n0 + j] : acc);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// M rows against one 16-column block: u8 x s8 pair products (VPMADDUBSW) of both 8-column
// halves of a chunk from one broadcast of the row's 4 activations, summed in int16 over a
// group (4 bits: at most 16 * 15 * 127 = 30480; 8 bits as two nibbles, each summed so),
// then widened (VPMADDWD) and scaled in fp32 once per group.
template <int M, int BITS, typename T>
__attribute__((noinline)) void quant_block(const QuantizedRows& rows, int64_t m0, int64_t K,
                                           const uint8_t* __restrict w, const float* bias,
                                           int64_t n0, int width, T* __restrict out,
                                           int64_t N) {
  const int64_t groups = K / QGROUP, group_bytes = BITS == 4 ? Q4_GROUP_BYTES : Q8_GROUP_BYTES;
  const int quant_bytes = BITS == 4 ? 256 : 512;
  const __m256i nibble = _mm256_set1_epi8(15);
  const int8_t* qa = rows.qa.data() + m0 * K;
  const float* d = rows.d.data() + m0 * groups;
  const float* s = rows.s.data() + m0 * groups;
  auto broadcast = [](const int8_t* p) {
    int32_t four;
    std::memcpy(&four, p, sizeof(four));
    return _mm256_set1_epi32(four);
  };
  auto load = [](const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  auto widen = [](__m256i sums) { return _mm256_madd_epi16(sums, _mm256_set1_epi16(1)); };
  // a 64-byte chunk's low and high nibbles, for the 8-column halves 0 and 1
  auto nibbles = [&](const uint8_t* chunk) {
    const __m256i v0 = load(chunk), v1 = load(chunk + 32);
    return std::array<__m256i, 4>{
        _mm256_and_si256(v0, nibble), _mm256_and_si256(v1, nibble),
        _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble),
        _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble)};
  };
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* base = w + g * group_bytes;
    const int8_t* a = qa + g * QGROUP;
    __m256i dots[M][2];
    if constexpr (BITS == 4) {
      __m256i sums[M][2];
      for (int m = 0; m < M; ++m) sums[m][0] = sums[m][1] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const auto [lo0, lo1, hi0, hi1] = nibbles(base + 64 * c);
        for (int m = 0; m < M; ++m) {
          const __m256i first = broadcast(a + m * K + 8 * c);
          const __m256i second = broadcast(a + m * K + 8 * c + 4);
          sums[m][0] = _mm256_add_epi16(sums[m][0], _mm256_maddubs_epi16(lo0, first));
          sums[m][1] = _mm256_add_epi16(sums[m][1], _mm256_maddubs_epi16(lo1, first));
          sums[m][0] = _mm256_add_epi16(sums[m][0], _mm256_maddubs_epi16(hi0, second));
          sums[m][1] = _mm256_add_epi16(sums[m][1], _mm256_maddubs_epi16(hi1, second));
        }
      }
      for (int m = 0; m < M; ++m) {
        dots[m][0] = widen(sums[m][0]);
        dots[m][1] = widen(sums[m][1]);
      }
    } else {
      __m256i low[M][2], high[M][2];
      for (int m = 0; m < M; ++m)
        low[m][0] = low[m][1] = high[m][0] = high[m][1] = _mm256_setzero_si256();
      for (int r = 0; r < 8; ++r) {
        const auto [lo0, lo1, hi0, hi1] = nibbles(base + 64 * r);
        for (int m = 0; m < M; ++m) {
          const __m256i four = broadcast(a + m * K + 4 * r);
          low[m][0] = _mm256_add_epi16(low[m][0], _mm256_maddubs_epi16(lo0, four));
          low[m][1] = _mm256_add_epi16(low[m][1], _mm256_maddubs_epi16(lo1, four));
          high[m][0] = _mm256_add_epi16(high[m][0], _mm256_maddubs_epi16(hi0, four));
          high[m][1] = _mm256_add_epi16(high[m][1], _mm256_maddubs_epi16(hi1, four));
        }
      }
      for (int m = 0; m < M; ++m)
        for (int h = 0; h < 2; ++h)
          dots[m][h] = _mm256_add_epi32(widen(low[m][h]), _mm256_slli_epi32(widen(high[m][h]), 4));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + quant_bytes + 16 * h)));
      const __m256 minimum = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + quant_bytes + 32 + 16 * h)));
      for (int m = 0; m < M; ++m) {
        const __m256 factor = _mm256_mul_ps(scale, _mm256_set1_ps(d[m * groups + g]));
        acc[m][h] = _mm256_fmadd_ps(factor, _mm256_cvtepi32_ps(dots[m][h]), acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(s[m * groups + g]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    float row[LANES];
    _mm256_storeu_ps(row, acc[m][0]);
    _mm256_storeu_ps(row + 8, acc[m][1]);
    T* dst = out + (m0 + m) * N + n0;
    for (int j = 0; j < width; ++j) store_float(dst + j, bias ? row[j] + bias[n0 + j] : row[j]);
  }
}
#endif

// y [M, N] = x @ W^T (+ bias) for W quantized and packed (above); x in the model dtype T
template <typename T>
void quantized_linear_impl(const T* x, int64_t M, int64_t K, const at::Tensor& packed,
                           const float* bias, T* out, int64_t N, QuantizedRows& rows) {
  quantize_rows(x, M, K, rows);
  const int64_t blocks = packed.size(0), bits = quant_bits(packed);
  const int64_t block_bytes = packed.size(1) * packed.size(2);
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, block_bytes / 4 * M));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const uint8_t* w = weights + block * block_bytes;
      const int64_t n0 = block * LANES;
      const int width = static_cast<int>(std::min<int64_t>(LANES, N - n0));
      for (int64_t m0 = 0; m0 < M; m0 += QUANT_TILE) {
        const int tile = static_cast<int>(std::min<int64_t>(QUANT_TILE, M - m0));
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        if (bits == 4) {
          with_rows<QUANT_TILE>(tile, [&](auto R) {
            quant_block<R, 4>(rows, m0, K, w, bias, n0, width, out, N);
          });
        } else {  // two rows' nibble sums fill the 16 vector registers
          for (int64_t r0 = m0; r0 < m0 + tile; r0 += 2) {
            if (m0 + tile - r0 >= 2)
              quant_block<2, 8>(rows, r0, K, w, bias, n0, width, out, N);
            else
              quant_block<1, 8>(rows, r0, K, w, bias, n0, width, out, N);
          }
        }
#else
        if (bits == 4)
          quant_block_scalar<4>(rows, m0, tile, K, w, bias, n0, width, out, N);
        else
          quant_block_scalar<8>(rows, m0, tile, K, w, bias, n0, width, out, N);
#endif
      }
    }
  });
}

// the reference (scalar) arithmetic of quantized_linear_impl, for the tests
at::Tensor quantized_linear_reference(const at::Tensor& x, const at::Tensor& packed,
                                      int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && is_quantized(packed),
              "quantized_linear_reference: fp32 x [M, K] and a quantized packed weight");
  at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor out = at::empty({M, out_features}, xc.options());
  QuantizedRows rows;
  quantize_rows(xc.data_ptr<float>(), M, K, rows);
  const int64_t block_bytes = packed.size(1) * packed.size(2);
  for (int64_t block = 0; block < packed.size(0); ++block) {
    const int64_t n0 = block * LANES;
    const int width = static_cast<int>(std::min<int64_t>(LANES, out_features - n0));
    const uint8_t* w = packed.data_ptr<uint8_t>() + block * block_bytes;
    if (quant_bits(packed) == 4)
      quant_block_scalar<4>(rows, 0, M, K, w, nullptr, n0, width, out.data_ptr<float>(),
                            out_features);
    else
      quant_block_scalar<8>(rows, 0, M, K, w, nullptr, n0, width, out.data_ptr<float>(),
                            out_features);
  }
  return out;
}

// W [N, K] in the layout packed_linear reads (see above): [ceil(N / 16), K, 16], or for
// bf16 with AVX512-BF16 [ceil(N / 16), ceil(K / 2), 16, 2]; zero-padded.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: weight must be [out, in]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "pack_linear_weight: float32 or bfloat16 only");
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + LANES - 1) / LANES;
  const bool pairs = weight.scalar_type() == at::kBFloat16 && BF16_PAIRS;
  const int64_t width = pairs ? (K + 1) / 2 * 2 : K;
  at::Tensor padded = at::zeros({blocks * LANES, width}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  if (pairs)  // [blocks, 16, pairs, 2] -> [blocks, pairs, 16, 2]
    return padded.view({blocks, LANES, width / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  return padded.view({blocks, LANES, K}).transpose(1, 2).contiguous();
}

bool is_pairs(const at::Tensor& packed) { return packed.dim() == 4; }

// y [M, N] = x [M, K] @ W^T (+ bias) for x in the model dtype T and W packed; scratch
// buffers are reused across calls.
template <typename T>
void run_linear(const T* x, int64_t M, int64_t K, const at::Tensor& packed, const float* bias,
                T* out, int64_t N, std::vector<float>& x32, std::vector<uint32_t>& x_pairs) {
  if (M == 0) return;
  if (is_quantized(packed)) {
    static thread_local QuantizedRows rows;  // reused by every call of this thread
    quantized_linear_impl(x, M, K, packed, bias, out, N, rows);
    return;
  }
  if constexpr (std::is_same_v<T, bf16_bits>) {
#if defined(__AVX512BF16__)
    if (is_pairs(packed)) {
      const int64_t pairs = packed.size(1);
      const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
      if (K % 2) {  // pad each row with a zero to whole pairs
        x_pairs.assign(M * pairs, 0);
        for (int64_t m = 0; m < M; ++m)
          std::memcpy(x_pairs.data() + m * pairs, x + m * K, K * sizeof(bf16_bits));
        xp = x_pairs.data();
      }
      packed_linear_impl(xp, M, pairs, reinterpret_cast<const uint32_t*>(packed.data_ptr()),
                         packed.size(0), bias, out, N);
      return;
    }
#endif
  }
  TORCH_CHECK(!is_pairs(packed), "packed_linear: this build reads no bf16 pair layout");
  const float* x_float;
  if constexpr (std::is_same_v<T, float>) {
    x_float = x;
  } else {
    x32.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) x32[i] = load_float(x + i);
    x_float = x32.data();
  }
  packed_linear_impl(x_float, M, K, reinterpret_cast<const T*>(packed.data_ptr()),
                     packed.size(0), bias, out, N);
}

int64_t packed_in_features(const at::Tensor& packed) {
  if (is_quantized(packed)) return packed.size(1) * QGROUP;
  return is_pairs(packed) ? packed.size(1) * 2 : packed.size(1);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2, "packed_linear: x must be [rows, in_features], got ", x.sizes());
  const bool quantized = is_quantized(packed);
  TORCH_CHECK(((packed.dim() == 3 && packed.size(2) == LANES) ||
               (packed.dim() == 4 && packed.size(2) == LANES && packed.size(3) == 2) ||
               (quantized && packed.dim() == 3 &&
                (packed.size(2) == Q4_GROUP_BYTES || packed.size(2) == Q8_GROUP_BYTES))) &&
                  packed.is_contiguous(),
              "packed_linear: packed must come from pack_linear_weight or the quantized "
              "packing, got ", packed.sizes(), " ", packed.scalar_type());
  TORCH_CHECK(quantized || x.scalar_type() == packed.scalar_type(), "packed_linear: x is ",
              x.scalar_type(), " but packed is ", packed.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(quantized ? K == packed_in_features(packed)
              : is_pairs(packed) ? (K + 1) / 2 == packed.size(1) : K == packed.size(1),
              "packed_linear: x has ", K, " features, packed ", packed_in_features(packed));
  TORCH_CHECK(out_features > (blocks - 1) * LANES && out_features <= blocks * LANES,
              "packed_linear: out_features ", out_features, " does not fit ", blocks, " blocks");
  at::Tensor xc = x.contiguous();
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features,
                "packed_linear: bias must be [out_features]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, out_features}, x.options());
  const float* bias_ptr = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  std::vector<float> x32;
  std::vector<uint32_t> x_pairs;
  dispatch_dtype(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    run_linear<T>(data_of<T>(xc), M, K, packed, bias_ptr, data_of<T>(out), out_features, x32,
                  x_pairs);
  }, "packed_linear: float32 or bfloat16, got ", x.scalar_type());
  return out;
}

// ------------------------------------------------------------------ K/V store

template <typename T>
void store_kv_impl(T* k_cache, T* v_cache, const T* k, const T* v, const int64_t* slots,
                   int64_t tokens, int64_t kv_heads, int64_t num_blocks, int64_t dim,
                   int64_t block_size) {
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t g = 0; g < kv_heads; ++g) {
      const T* k_row = k + (t * kv_heads + g) * dim;
      const T* v_row = v + (t * kv_heads + g) * dim;
      T* k_block = k_cache + (g * num_blocks + block) * dim * block_size + offset;
      T* v_block = v_cache + ((g * num_blocks + block) * block_size + offset) * dim;
      for (int64_t d = 0; d < dim; ++d) k_block[d * block_size] = k_row[d];
      std::memcpy(v_block, v_row, dim * sizeof(T));
    }
  }
}

void store_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k.is_contiguous() &&
                  v.is_contiguous() && slot_mapping.is_contiguous(),
              "store_kv: contiguous tensors only");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "store_kv: slot_mapping must be int64");
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1);
  const int64_t dim = k_cache.size(2), block_size = k_cache.size(3);
  const int64_t tokens = k.size(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  dispatch_dtype(k_cache, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    store_kv_impl<T>(data_of<T>(k_cache), data_of<T>(v_cache), data_of<T>(k), data_of<T>(v),
                     slots, tokens, kv_heads, num_blocks, dim, block_size);
  }, "store_kv: float32 or bfloat16 only");
}

// ------------------------------------------------------------------ paged attention

// items [I, 6] int32: (table list index, table row, key_len, row_begin, row_count, causal).
// Item i: the q rows item_rows[row_begin : row_begin + row_count] attend to key_len keys at
// the blocks tables[list][row]; causal: its row r sits at position key_len - row_count + r
// and sees keys 0 .. that position; else every row sees all key_len keys.
// item_first [N] int32 (sliding-window attention; optional, aligned with item_rows): the
// first key of its item each row may see; keys before it are masked, and key runs before
// the lowest of a unit's rows are not read at all.
enum ItemField { TABLE_LIST, TABLE_ROW, KEY_LEN, ROW_BEGIN, ROW_COUNT, CAUSAL, ITEM_FIELDS };

struct Unit {  // one item's rows [r0, r1), one KV head, keys [k0, k1)
  int64_t item, head, r0, r1, k0, k1;
  int64_t entry;  // first partial-result entry: (r1 - r0) * group of them, row-major
};

struct Partials {  // unnormalized partial softmax results, one entry per (unit row, head)
  std::vector<float> acc;  // [entries, dim]
  std::vector<float> max;  // [entries]
  std::vector<float> sum;  // [entries]
  // Batch-invariant mode: each (token, query head)'s running softmax state, carried from
  // one wave of units to the next (its shared segments, level after level, then its own
  // keys) instead of partial results merged at the end.
  std::vector<float> state_acc;    // [tokens * heads, dim]
  std::vector<float> state_max;    // [tokens * heads]
  std::vector<float> state_lanes;  // [tokens * heads, LANES]: the denominators lane by lane
};

// Scores of up to 8 query vectors q [n][dim] against 16 keys kt [dim][stride]:
// scores[i * score_stride + j] for lanes j = 0..15.
template <int N, typename T>
inline void score_tile(const float* __restrict q, int64_t dim, const T* __restrict kt,
                       int64_t stride, float* __restrict scores, int64_t score_stride) {
  Lanes sums[N];
  for (int i = 0; i < N; ++i) sums[i] = lanes_zero();
  for (int64_t d = 0; d < dim; ++d) {
    const Lanes keys = lanes_load(kt + d * stride);
    UNROLL_PAIRS
    for (int i = 0; i < N; ++i) sums[i] = lanes_fma(q[i * dim + d], keys, sums[i]);
  }
  for (int i = 0; i < N; ++i) lanes_store(scores + i * score_stride, sums[i]);
}

// value_tile's head dimensions d0.. past its last whole 16 (a head_dim not a multiple of 16)
template <int N, typename T>
ALWAYS_INLINE void value_tail(int64_t d0, const float* __restrict weights, int64_t weight_stride,
                              const float* __restrict correction, const T* __restrict v,
                              int64_t dim, int keys, float* __restrict acc) {
  for (; d0 < dim; ++d0) {
    for (int i = 0; i < N; ++i) {
      float sum = acc[i * dim + d0] * correction[i];
      for (int j = 0; j < keys; ++j)
        sum += weights[i * weight_stride + j] * load_float(v + j * dim + d0);
      acc[i * dim + d0] = sum;
    }
  }
}

// acc[i][:] = acc[i][:] * correction[i] + sum_{j < keys} weights[i][j] * v[j][:] for up to
// 8 query vectors: P [n, 16] x V [16, dim], each V vector loaded once for all n queries.
template <int N, typename T>
inline void value_tile(const float* __restrict weights, int64_t weight_stride,
                       const float* __restrict correction, const T* __restrict v, int64_t dim,
                       int keys, float* __restrict acc) {
  int64_t d0 = 0;
  for (; d0 + LANES <= dim; d0 += LANES) {
    Lanes sums[N];
    for (int i = 0; i < N; ++i)
      sums[i] = lanes_scale(lanes_load(acc + i * dim + d0), correction[i]);
    for (int j = 0; j < keys; ++j) {
      const Lanes values = lanes_load(v + j * dim + d0);
      UNROLL_PAIRS
      for (int i = 0; i < N; ++i)
        sums[i] = lanes_fma(weights[i * weight_stride + j], values, sums[i]);
    }
    for (int i = 0; i < N; ++i) lanes_store(acc + i * dim + d0, sums[i]);
  }
  value_tail<N>(d0, weights, weight_stride, correction, v, dim, keys, acc);
}

// The tiles of n = 1..TILE_QUERIES query vectors (called, not inlined into run_unit: faster)
template <typename T>
void score_rows(int n, const float* q, int64_t dim, const T* kt, int64_t stride, float* scores,
                int64_t score_stride) {
  with_rows<TILE_QUERIES>(
      n, [&](auto N) { score_tile<N>(q, dim, kt, stride, scores, score_stride); });
}

template <typename T>
void value_rows(int n, const float* weights, int64_t weight_stride, const float* correction,
                const T* v, int64_t dim, int keys, float* acc) {
  with_rows<TILE_QUERIES>(
      n, [&](auto N) { value_tile<N>(weights, weight_stride, correction, v, dim, keys, acc); });
}

#if defined(__AVX512BF16__)
// bf16 attention with AVX512-BF16: each VDPBF16PS multiplies 16 lanes by two values at once.
// Scores: 16 keys per lane vector, pairs of head dimensions (two K rows interleaved);
// values: 16 head dimensions per lane vector, pairs of keys (two V rows interleaved), the
// softmax weights rounded to bf16 first, as Hugging Face's eager bf16 attention rounds them.

// rows a, b of 16 bf16 each -> 16 pairs (a[j], b[j])
inline __m512i interleave_rows(__m256i a, __m256i b) {
  const __m512i index = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                         8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(index,
                                  _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}

inline __m256i load_row16(const bf16_bits* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// scores[i][0..16] = scale * q[i] . k[0..16] for up to 8 queries given as bf16 pairs
// q [N][dim / 2], keys kt [dim][stride] (bf16)
template <int N>
inline void score_tile_dot(const uint32_t* __restrict q, int64_t half, const bf16_bits* kt,
                           int64_t stride, float* __restrict scores, int64_t score_stride,
                           float scale) {
  __m512 sums[N];
  for (int i = 0; i < N; ++i) sums[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < half; ++p) {
    const __m512bh keys = (__m512bh)interleave_rows(load_row16(kt + 2 * p * stride),
                                                    load_row16(kt + (2 * p + 1) * stride));
    for (int i = 0; i < N; ++i)
      sums[i] = _mm512_dpbf16_ps(sums[i], (__m512bh)_mm512_set1_epi32(q[i * half + p]), keys);
  }
  const __m512 factor = _mm512_set1_ps(scale);
  for (int i = 0; i < N; ++i)
    _mm512_storeu_ps(scores + i * score_stride, _mm512_mul_ps(sums[i], factor));
}

// as value_tile, the weights rounded to bf16 and V read as pairs of keys
template <int N>
inline void value_tile_dot(const float* __restrict weights, int64_t weight_stride,
                           const float* __restrict correction, const bf16_bits* v, int64_t dim,
                           int keys, float* __restrict acc) {
  uint32_t pairs[N][LANES / 2];
  for (int i = 0; i < N; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs[i]),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(weights + i * weight_stride)));
  const int key_pairs = (keys + 1) / 2;
  int64_t d0 = 0;
  for (; d0 + LANES <= dim; d0 += LANES) {
    __m512 sums[N];
    for (int i = 0; i < N; ++i)
      sums[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * dim + d0), _mm512_set1_ps(correction[i]));
    for (int p = 0; p < key_pairs; ++p) {
      const __m256i first = load_row16(v + 2 * p * dim + d0);
      const __m256i second =
          2 * p + 1 < keys ? load_row16(v + (2 * p + 1) * dim + d0) : _mm256_setzero_si256();
      const __m512bh values = (__m512bh)interleave_rows(first, second);
      for (int i = 0; i < N; ++i)
        sums[i] = _mm512_dpbf16_ps(sums[i], (__m512bh)_mm512_set1_epi32(pairs[i][p]), values);
    }
    for (int i = 0; i < N; ++i) _mm512_storeu_ps(acc + i * dim + d0, sums[i]);
  }
  value_tail<N>(d0, weights, weight_stride, correction, v, dim, keys, acc);
}

void score_rows_dot(int n, const uint32_t* q, int64_t half, const bf16_bits* kt, int64_t stride,
                    float* scores, int64_t score_stride, float scale) {
  with_rows<TILE_QUERIES>(n, [&](auto N) {
    score_tile_dot<N>(q, half, kt, stride, scores, score_stride, scale);
  });
}

void value_rows_dot(int n, const float* weights, int64_t weight_stride, const float* correction,
                    const bf16_bits* v, int64_t dim, int keys, float* acc) {
  with_rows<TILE_QUERIES>(n, [&](auto N) {
    value_tile_dot<N>(weights, weight_stride, correction, v, dim, keys, acc);
  });
}
#endif

struct StepTensors {  // one step's attention metadata, checked once
  const int32_t* items;
  int64_t num_items;
  const int32_t* item_rows;
  const int32_t* item_first;  // sliding window: see ItemField; null: none
  std::vector<const int32_t*> tables;
  std::vector<int64_t> table_widths;
};

template <typename T>
struct AttentionArgs : StepTensors {
  const T* q;  // [tokens, heads, dim]
  const T* k_cache;
  const T* v_cache;
  int64_t heads, kv_heads, num_blocks, dim, block_size;
  float scale;
};

// Up to SUB_TILES runs of at most 16 keys, each inside one block, form one softmax step.
constexpr int SUB_TILES = 4;
constexpr int STEP_KEYS = SUB_TILES * LANES;

struct UnitScratch {  // one thread's buffers, reused unit after unit
  std::vector<float> values;
  std::vector<uint32_t> query_pairs;  // bf16 dot path: queries as pairs of dimensions
  std::vector<bf16_bits> key_copies;  // bf16 dot path: zero-padded partial key tiles
};

// A query's running maximum moved to max(run_max, step_max), and the factor for what it
// had summed so far (correction = exp(old - new)); false where it sees no key yet (its
// step weights set to 0, correction 1).
ALWAYS_INLINE bool advance_max(float step_max, float& run_max, float* weights,
                               float& correction) {
  const float new_max = std::max(run_max, step_max);
  if (new_max == NEG_INF) {
    correction = 1.0f;
    std::fill(weights, weights + STEP_KEYS, 0.0f);
    return false;
  }
  correction = exp_nonpositive(run_max - new_max);
  run_max = new_max;
  return true;
}

// One query's online-softmax step over `count` runs of 16 scores (row stride LANES): lanes
// [masked[t], valid[t]) of run t are its visible keys. Updates run_max and the denominators
// lane by lane (sums [LANES]); writes the weights exp(score - max) (0 where not visible)
// and the factor for the running values (correction). False: it sees no key yet (weights
// 0, correction 1, nothing else changed).
#if defined(HAVE_EXP8)
ALWAYS_INLINE bool softmax_query(const float* scores, float* weights, int count,
                                 const int* valid, const int* masked, float& run_max,
                                 float* sums, float& correction) {
  const __m256 lanes_lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 lanes_hi = _mm256_add_ps(lanes_lo, _mm256_set1_ps(8.0f));
  const __m256 none = _mm256_set1_ps(NEG_INF);
  __m256 keep_lo[SUB_TILES], keep_hi[SUB_TILES];
  __m256 max_lo = none, max_hi = none;
  for (int t = 0; t < count; ++t) {
    const __m256 v = _mm256_set1_ps(static_cast<float>(valid[t]));
    const __m256 m = _mm256_set1_ps(static_cast<float>(masked[t]));
    keep_lo[t] = _mm256_and_ps(_mm256_cmp_ps(lanes_lo, v, _CMP_LT_OQ),
                               _mm256_cmp_ps(lanes_lo, m, _CMP_GE_OQ));
    keep_hi[t] = _mm256_and_ps(_mm256_cmp_ps(lanes_hi, v, _CMP_LT_OQ),
                               _mm256_cmp_ps(lanes_hi, m, _CMP_GE_OQ));
    const float* row = scores + t * LANES;
    max_lo = _mm256_max_ps(max_lo, _mm256_blendv_ps(none, _mm256_loadu_ps(row), keep_lo[t]));
    max_hi = _mm256_max_ps(max_hi, _mm256_blendv_ps(none, _mm256_loadu_ps(row + 8), keep_hi[t]));
  }
  __m256 top = _mm256_max_ps(max_lo, max_hi);
  top = _mm256_max_ps(top, _mm256_permute2f128_ps(top, top, 1));
  top = _mm256_max_ps(top, _mm256_shuffle_ps(top, top, _MM_SHUFFLE(1, 0, 3, 2)));
  top = _mm256_max_ps(top, _mm256_shuffle_ps(top, top, _MM_SHUFFLE(2, 3, 0, 1)));
  if (!advance_max(_mm256_cvtss_f32(top), run_max, weights, correction)) return false;
  const __m256 shift = _mm256_set1_ps(run_max), factor = _mm256_set1_ps(correction);
  __m256 sum_lo = _mm256_mul_ps(_mm256_loadu_ps(sums), factor);
  __m256 sum_hi = _mm256_mul_ps(_mm256_loadu_ps(sums + 8), factor);
  for (int t = 0; t < count; ++t) {
    const float* row = scores + t * LANES;
    const __m256 e_lo = _mm256_and_ps(
        keep_lo[t], exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(row), shift)));
    const __m256 e_hi = _mm256_and_ps(
        keep_hi[t], exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(row + 8), shift)));
    _mm256_storeu_ps(weights + t * LANES, e_lo);
    _mm256_storeu_ps(weights + t * LANES + 8, e_hi);
    sum_lo = _mm256_add_ps(sum_lo, e_lo);
    sum_hi = _mm256_add_ps(sum_hi, e_hi);
  }
  _mm256_storeu_ps(sums, sum_lo);
  _mm256_storeu_ps(sums + 8, sum_hi);
  return true;
}
#else
ALWAYS_INLINE bool softmax_query(const float* scores, float* weights, int count,
                                 const int* valid, const int* masked, float& run_max,
                                 float* sums, float& correction) {
  float lane_max[LANES];
  for (int j = 0; j < LANES; ++j) lane_max[j] = NEG_INF;
  for (int t = 0; t < count; ++t) {
    const float* row = scores + t * LANES;
    const int v = valid[t], m = masked[t];
#pragma omp simd
    for (int j = 0; j < LANES; ++j)
      lane_max[j] = std::max(lane_max[j], j < v && j >= m ? row[j] : NEG_INF);
  }
  float step_max = NEG_INF;
#pragma omp simd reduction(max : step_max)
  for (int j = 0; j < LANES; ++j) step_max = std::max(step_max, lane_max[j]);
  if (!advance_max(step_max, run_max, weights, correction)) return false;
  const float new_max = run_max, c = correction;
  float step_sums[LANES];
  for (int j = 0; j < LANES; ++j) step_sums[j] = sums[j] * c;
  for (int t = 0; t < count; ++t) {
    const float* row = scores + t * LANES;
    float* w = weights + t * LANES;
    const int v = valid[t], m = masked[t];
#pragma omp simd
    for (int j = 0; j < LANES; ++j) {
      const float e = j < v && j >= m ? exp_nonpositive(row[j] - new_max) : 0.0f;
      w[j] = e;
      step_sums[j] += e;
    }
  }
  for (int j = 0; j < LANES; ++j) sums[j] = step_sums[j];
  return true;
}
#endif

// carried: batch-invariant mode (see AttentionPlan::invariant): the unit starts from its
// queries' running state in out.state_* and leaves it there. sub_tiles: runs of keys per
// softmax step (SUB_TILES; 1 where steps must be the blocks themselves).
template <typename T>
void run_unit(const AttentionArgs<T>& a, const Unit& u, Partials& out, UnitScratch& buffers,
              bool carried, int sub_tiles) {
  const int32_t* item = a.items + u.item * ITEM_FIELDS;
  const int64_t group = a.heads / a.kv_heads, dim = a.dim, block_size = a.block_size;
  const int64_t key_len = item[KEY_LEN], row_count = item[ROW_COUNT];
  const bool causal = item[CAUSAL] != 0;
  const int32_t* table =
      a.tables[item[TABLE_LIST]] + item[TABLE_ROW] * a.table_widths[item[TABLE_LIST]];
  const int32_t* rows = a.item_rows + item[ROW_BEGIN];
  const int64_t queries = (u.r1 - u.r0) * group;
  // scratch: q [queries, dim] (scaled), SUB_TILES key tiles [dim, 16], limits [queries],
  // the softmax denominators lane by lane [queries, 16] (summed across lanes at the end),
  // the first visible key of each query [queries]
  std::vector<float>& scratch = buffers.values;
  scratch.resize(queries * dim + SUB_TILES * dim * LANES + 2 * queries + queries * LANES);
  float* q = scratch.data();
#if defined(__AVX512BF16__)
  // bf16 with AVX512-BF16: scores and values by dot products of bf16 pairs
  constexpr bool dot = std::is_same_v<T, bf16_bits>;
#else
  constexpr bool dot = false;
#endif
  const bool use_dot = dot && dim % 2 == 0;
  const int64_t half = dim / 2;
  uint32_t* q_pairs = nullptr;
  bf16_bits* key_copies = nullptr;
  if (use_dot) {
    buffers.query_pairs.resize(queries * half);
    buffers.key_copies.resize(SUB_TILES * dim * LANES);
    q_pairs = buffers.query_pairs.data();
    key_copies = buffers.key_copies.data();
  }
  float* key_tiles = q + queries * dim;
  float* limit = key_tiles + SUB_TILES * dim * LANES;
  float* lane_sums = limit + queries;
  float* low = lane_sums + queries * LANES;
  std::fill(lane_sums, lane_sums + queries * LANES, 0.0f);
  const int32_t* firsts = a.item_first ? a.item_first + item[ROW_BEGIN] : nullptr;
  for (int64_t r = u.r0; r < u.r1; ++r) {
    const T* q_row = a.q + (static_cast<int64_t>(rows[r]) * a.heads + u.head * group) * dim;
    for (int64_t j = 0; j < group; ++j) {
      const int64_t query = (r - u.r0) * group + j;
      float* dst = q + query * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = load_float(q_row + j * dim + d) * a.scale;
      if (use_dot)  // the raw bf16 query, dimensions 2p and 2p + 1 in one 32-bit lane
        std::memcpy(q_pairs + query * half, q_row + j * dim, dim * sizeof(T));
      limit[query] = static_cast<float>(causal ? key_len - row_count + r + 1 : key_len);
      low[query] = firsts ? static_cast<float>(std::max<int32_t>(0, firsts[r])) : 0.0f;
    }
  }
  float* acc = out.acc.data() + u.entry * dim;
  float* run_max = out.max.data() + u.entry;
  float* run_sum = out.sum.data() + u.entry;
  std::fill(acc, acc + queries * dim, 0.0f);
  std::fill(run_max, run_max + queries, NEG_INF);
  std::fill(run_sum, run_sum + queries, 0.0f);
  // carried: each query's running state copied in from out.state_* (in) or back out
  auto carry = [&](bool in) {
    for (int64_t query = 0; query < queries; ++query) {
      // unit query (r - r0) * group + j: token rows[r], head head * group + j
      const int64_t s = static_cast<int64_t>(rows[u.r0 + query / group]) * a.heads +
                        u.head * group + query % group;
      auto copy = [&](float* unit, float* state, int64_t n) {  // a loop: n is small, and a
        const float* from = in ? state : unit;  // memcpy call per state cost a third of a
        float* to = in ? unit : state;          // prefill step's attention on two threads
        for (int64_t i = 0; i < n; ++i) to[i] = from[i];
      };
      copy(acc + query * dim, out.state_acc.data() + s * dim, dim);
      copy(run_max + query, out.state_max.data() + s, 1);
      copy(lane_sums + query * LANES, out.state_lanes.data() + s * LANES, LANES);
    }
  };
  if (carried) carry(true);
  const int64_t visible_end = std::min<int64_t>(u.k1, static_cast<int64_t>(limit[queries - 1]));
  float scores[TILE_QUERIES][STEP_KEYS];  // row stride STEP_KEYS
  float weights[TILE_QUERIES][STEP_KEYS];
  float correction[TILE_QUERIES];
  float ones[TILE_QUERIES];
  std::fill(ones, ones + TILE_QUERIES, 1.0f);
  struct SubTile {
    int64_t first;  // key index of lane 0
    int width;
    const void* keys;  // [dim, stride] of T (in place) or float (a zero-padded copy)
    bool copied;
    int64_t stride;
    const T* values;  // [width, dim]
  } tiles[SUB_TILES];
  struct Run {  // the keys from k: at most 16, inside one block, before visible_end
    int width;
    const T* keys;  // [dim, block_size] from the first
    const T* values;  // [width, dim]
  };
  auto run_at = [&](int64_t k) -> Run {
    const int64_t block = u.head * a.num_blocks + table[k / block_size], offset = k % block_size;
    return {static_cast<int>(std::min<int64_t>({LANES, block_size - offset, visible_end - k})),
            a.k_cache + block * dim * block_size + offset,
            a.v_cache + (block * block_size + offset) * dim};
  };
  for (int64_t k = u.k0; k < visible_end;) {
    int count = 0;
    for (; count < sub_tiles && k < visible_end; ++count) {
      const Run run = run_at(k);
      // Lanes past the tile's width read later slots of the same block row (stale or unwritten
      // keys, masked out of the softmax); a tile that would leave its block row (blocks of
      // fewer than 16 tokens, or not a multiple of 16) is copied, zero-padded, instead.
      const bool copied = k % block_size + LANES > block_size;
      SubTile& tile = tiles[count];
      tile = {k, run.width, run.keys, copied, copied ? LANES : block_size, run.values};
      auto copy_keys = [&](auto* copy, auto load) {
        for (int64_t d = 0; d < dim; ++d)
          for (int j = 0; j < LANES; ++j)
            copy[d * LANES + j] = j < run.width ? load(run.keys + d * block_size + j) : 0;
        tile.keys = copy;
      };
      if (copied && use_dot)  // the raw bf16 keys
        copy_keys(key_copies + count * dim * LANES, [](const T* p) { return *p; });
      else if (copied)
        copy_keys(key_tiles + count * dim * LANES, [](const T* p) { return load_float(p); });
      k += run.width;
    }
    // start loading the next step's keys and values while this one computes
    for (int64_t next = k, t = 0; next < visible_end && t < sub_tiles; ++t) {
      const Run run = run_at(next);
      for (int64_t d = 0; d < dim; ++d) __builtin_prefetch(run.keys + d * block_size);
      const char* v_bytes = reinterpret_cast<const char*>(run.values);
      for (int64_t line = 0; line < int64_t(run.width * dim * sizeof(T)); line += 64)
        __builtin_prefetch(v_bytes + line);
      next += run.width;
    }
    for (int64_t i0 = 0; i0 < queries; i0 += TILE_QUERIES) {
      const int n = static_cast<int>(std::min<int64_t>(TILE_QUERIES, queries - i0));
      for (int t = 0; t < count; ++t) {
        const SubTile& tile = tiles[t];
        float* tile_scores = scores[0] + t * LANES;
#if defined(__AVX512BF16__)
        if (use_dot) {
          score_rows_dot(n, q_pairs + i0 * half, half, static_cast<const bf16_bits*>(tile.keys),
                         tile.stride, tile_scores, STEP_KEYS, a.scale);
          continue;
        }
#endif
        if (tile.copied)
          score_rows<float>(n, q + i0 * dim, dim, static_cast<const float*>(tile.keys),
                            tile.stride, tile_scores, STEP_KEYS);
        else
          score_rows<T>(n, q + i0 * dim, dim, static_cast<const T*>(tile.keys), tile.stride,
                        tile_scores, STEP_KEYS);
      }
      // online softmax per query over the keys it sees in this step (a prefix of each tile)
      int keys[SUB_TILES] = {0, 0, 0, 0};
      for (int i = 0; i < n; ++i) {
        const int64_t query = i0 + i;
        const int64_t query_limit = static_cast<int64_t>(limit[query]);
        const int64_t query_low = static_cast<int64_t>(low[query]);
        int valid[SUB_TILES], masked[SUB_TILES];
        for (int t = 0; t < count; ++t) {
          valid[t] = static_cast<int>(std::max<int64_t>(
              0, std::min<int64_t>(tiles[t].width, query_limit - tiles[t].first)));
          // lanes below `masked` lie before the query's window
          masked[t] = static_cast<int>(
              std::min<int64_t>(std::max<int64_t>(0, query_low - tiles[t].first), LANES));
        }
        if (!softmax_query(scores[i], weights[i], count, valid, masked, run_max[query],
                           lane_sums + query * LANES, correction[i]))
          continue;  // sees no key yet: nothing changes
        for (int t = 0; t < count; ++t) keys[t] = std::max(keys[t], valid[t]);
      }
      // keys past a query's limit weigh 0 but are real (written) keys of this item
      for (int t = 0; t < count; ++t) {
        if (keys[t] == 0 && t > 0) continue;
        const float* factors = t == 0 ? correction : ones;
#if defined(__AVX512BF16__)
        if (use_dot) {
          value_rows_dot(n, weights[0] + t * LANES, STEP_KEYS, factors,
                         reinterpret_cast<const bf16_bits*>(tiles[t].values), dim, keys[t],
                         acc + i0 * dim);
          continue;
        }
#endif
        value_rows<T>(n, weights[0] + t * LANES, STEP_KEYS, factors, tiles[t].values, dim,
                      keys[t], acc + i0 * dim);
      }
    }
  }
  if (carried) return carry(false);
  for (int64_t query = 0; query < queries; ++query) {
    float total = 0.0f;
    for (int j = 0; j < LANES; ++j) total += lane_sums[query * LANES + j];
    run_sum[query] = total;
  }
}

template <typename T>
void merge_partials(const AttentionArgs<T>& a, const Partials& partials,
                    const std::vector<int64_t>& part_start, const std::vector<int64_t>& parts,
                    int64_t tokens, T* out) {
  const int64_t group = a.heads / a.kv_heads, dim = a.dim;
  at::parallel_for(0, tokens * a.kv_heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t t = pair / a.kv_heads, g = pair % a.kv_heads;
      for (int64_t j = 0; j < group; ++j) {
        float top = NEG_INF;
        for (int64_t p = part_start[pair]; p < part_start[pair + 1]; ++p)
          top = std::max(top, partials.max[parts[p] + j]);
        std::fill(merged.begin(), merged.end(), 0.0f);
        float total = 0.0f;
        if (top != NEG_INF) {
          for (int64_t p = part_start[pair]; p < part_start[pair + 1]; ++p) {
            const int64_t entry = parts[p] + j;
            if (partials.max[entry] == NEG_INF) continue;
            const float weight = std::exp(partials.max[entry] - top);
            total += partials.sum[entry] * weight;
            const float* acc = partials.acc.data() + entry * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) merged[d] += weight * acc[d];
          }
        }
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        T* dst = out + (t * a.heads + g * group + j) * dim;
        for (int64_t d = 0; d < dim; ++d) store_float(dst + d, merged[d] * inverse);
      }
    }
  });
}

// The units of one step's attention and where their partial results go, the same for
// every layer: built once per step (or per paged_attention call).
//
// Batch-invariant mode (split_keys <= 0): a row's result must not depend on which rows share
// the step, how its prompt was cut into shared segments or prefill chunks, or where it sits.
// So no key is split off into a partial merged later: units run in waves, each (token,
// head) carrying one running softmax state through its shared segments level by level and
// then its own keys; the state is normalized at the end. A query then reads the same keys
// in the same softmax steps whatever else runs, provided the steps are a function of the
// keys' positions: split_keys 0, one block a step (a segment read from inside a block
// starts on a block boundary: the scheduler copies that block's tail, copy_tails); split_keys < 0, SUB_TILES runs a step, where the caller starts every
// item's keys at a multiple of such a step (cpu_ops.attention_items' step_keys).
struct AttentionPlan {
  std::vector<Unit> units;
  bool invariant = false;
  int sub_tiles = SUB_TILES;  // runs of keys per softmax step
  std::vector<int64_t> wave_start;  // invariant: units of wave w at [wave_start[w], [w + 1])
  int64_t entries = 0;
  std::vector<int64_t> part_start;  // [tokens * kv_heads + 1]: CSR over (token, kv head)
  std::vector<int64_t> parts;       // partial entries of each (token, kv head)
};

AttentionPlan plan_attention(const StepTensors& step, int64_t tokens, int64_t heads,
                             int64_t kv_heads, int64_t block_size, int64_t split_keys) {
  const int32_t *items = step.items, *item_rows = step.item_rows, *item_first = step.item_first;
  const int64_t num_items = step.num_items, group = heads / kv_heads;
  AttentionPlan plan;
  // A unit takes up to 256 query vectors (rows x the query heads of one KV head) and reads
  // each key once for all of them. An item that fits one such tile (decode rows, short
  // chunks) is also cut into key chunks of split_keys, so few rows over a long prefix still
  // spread over the threads; a longer item (a prefill chunk) is cut into row tiles instead.
  const int64_t tile_rows = std::max<int64_t>(1, 256 / group);
  plan.invariant = split_keys <= 0;
  plan.sub_tiles = split_keys == 0 ? 1 : SUB_TILES;
  // invariant: an item's wave is its table list less one (shared levels 1.., in order);
  // own items (list 0) come last. Otherwise every item is in wave 0.
  int64_t waves = 1;
  if (plan.invariant)
    for (int64_t i = 0; i < num_items; ++i)
      waves = std::max<int64_t>(waves, items[i * ITEM_FIELDS + TABLE_LIST] + 1);
  auto wave_of = [&](int64_t i) -> int64_t {
    const int64_t list = items[i * ITEM_FIELDS + TABLE_LIST];
    return !plan.invariant ? 0 : (list == 0 ? waves - 1 : list - 1);
  };
  std::vector<int64_t> order(num_items);
  for (int64_t i = 0; i < num_items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return wave_of(x) < wave_of(y); });
  int64_t current_wave = -1;
  for (const int64_t i : order) {
    const int32_t* item = items + i * ITEM_FIELDS;
    for (; current_wave < wave_of(i); ++current_wave)
      plan.wave_start.push_back(static_cast<int64_t>(plan.units.size()));
    const int64_t key_len = item[KEY_LEN], row_count = item[ROW_COUNT];
    if (key_len <= 0 || row_count <= 0) continue;
    for (int64_t r0 = 0; r0 < row_count; r0 += tile_rows) {
      const int64_t r1 = std::min(row_count, r0 + tile_rows);
      const int64_t visible = item[CAUSAL] ? key_len - row_count + r1 : key_len;
      // sliding window: no unit reads keys before the lowest first key of its rows; the
      // start keeps the softmax steps where they were in the invariant mode (a step is
      // SUB_TILES runs of 16 keys from a multiple of STEP_KEYS, or one block's run)
      int64_t start = 0;
      if (item_first) {
        start = visible;
        for (int64_t r = r0; r < r1; ++r)
          start = std::min<int64_t>(start, std::max<int32_t>(0, item_first[item[ROW_BEGIN] + r]));
        const int64_t align = !plan.invariant ? LANES : plan.sub_tiles == 1 ? block_size : STEP_KEYS;
        start -= start % align;
      }
      const int64_t chunk = plan.invariant          ? visible
                            : row_count <= tile_rows ? split_keys
                                                     : visible;
      for (int64_t k0 = start; k0 < visible; k0 += chunk) {
        for (int64_t g = 0; g < kv_heads; ++g) {
          plan.units.push_back({i, g, r0, r1, k0, std::min(visible, k0 + chunk), plan.entries});
          plan.entries += (r1 - r0) * group;
        }
      }
    }
  }
  plan.wave_start.push_back(static_cast<int64_t>(plan.units.size()));
  if (plan.invariant) return plan;  // no partial results to merge
  const int64_t pairs = tokens * kv_heads;
  plan.part_start.assign(pairs + 1, 0);
  for (const Unit& u : plan.units) {
    const int32_t* rows = item_rows + items[u.item * ITEM_FIELDS + ROW_BEGIN];
    for (int64_t r = u.r0; r < u.r1; ++r) ++plan.part_start[rows[r] * kv_heads + u.head + 1];
  }
  for (int64_t p = 0; p < pairs; ++p) plan.part_start[p + 1] += plan.part_start[p];
  plan.parts.resize(plan.part_start[pairs]);
  std::vector<int64_t> fill(plan.part_start.begin(), plan.part_start.end() - 1);
  for (const Unit& u : plan.units) {
    const int32_t* rows = item_rows + items[u.item * ITEM_FIELDS + ROW_BEGIN];
    for (int64_t r = u.r0; r < u.r1; ++r)
      plan.parts[fill[rows[r] * kv_heads + u.head]++] = u.entry + (r - u.r0) * group;
  }
  return plan;
}

// Units [begin, end) of the plan, spread over the threads.
template <typename T>
void run_units(const AttentionArgs<T>& a, const AttentionPlan& plan, int64_t begin,
               int64_t end, Partials& partials) {
  const int64_t count = end - begin;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), count));
  // units differ in size (a long segment, a one-row decode): threads take them as they go
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    UnitScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = begin; u < end; ++u)
      run_unit(a, plan.units[u], partials, scratch, plan.invariant, plan.sub_tiles);
  }
}

// invariant plans: out = acc / (the lane denominators summed in lane order), 0 without keys
template <typename T>
void normalize_states(const AttentionArgs<T>& a, const Partials& partials, int64_t tokens,
                      T* out) {
  const int64_t dim = a.dim;
  at::parallel_for(0, tokens * a.heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      float total = 0.0f;
      for (int j = 0; j < LANES; ++j) total += partials.state_lanes[s * LANES + j];
      const bool seen = partials.state_max[s] != NEG_INF && total > 0.0f;
      const float inverse = seen ? 1.0f / total : 0.0f;
      const float* acc = partials.state_acc.data() + s * dim;
      for (int64_t d = 0; d < dim; ++d) store_float(out + s * dim + d, seen ? acc[d] * inverse : 0.0f);
    }
  });
}

template <typename T>
void run_attention(const AttentionArgs<T>& a, const AttentionPlan& plan, Partials& partials,
                   int64_t tokens, T* out) {
  partials.acc.resize(plan.entries * a.dim);
  partials.max.resize(plan.entries);
  partials.sum.resize(plan.entries);
  if (!plan.invariant) {
    run_units(a, plan, 0, static_cast<int64_t>(plan.units.size()), partials);
    merge_partials(a, partials, plan.part_start, plan.parts, tokens, out);
    return;
  }
  const int64_t states = tokens * a.heads;
  partials.state_acc.resize(states * a.dim);
  partials.state_max.resize(states);
  partials.state_lanes.resize(states * LANES);
  // fresh states, set on the threads (a serial fill cost a tenth of a prefill step)
  at::parallel_for(0, states, 256, [&](int64_t begin, int64_t end) {
    float* acc = partials.state_acc.data();
    float* lanes = partials.state_lanes.data();
    std::fill(acc + begin * a.dim, acc + end * a.dim, 0.0f);
    std::fill(partials.state_max.data() + begin, partials.state_max.data() + end, NEG_INF);
    std::fill(lanes + begin * LANES, lanes + end * LANES, 0.0f);
  });
  for (size_t w = 0; w + 1 < plan.wave_start.size(); ++w)  // shared levels, then own keys
    run_units(a, plan, plan.wave_start[w], plan.wave_start[w + 1], partials);
  normalize_states(a, partials, tokens, out);
}

StepTensors step_tensors(const std::vector<at::Tensor>& tables, const at::Tensor& items,
                         const at::Tensor& item_rows, const at::Tensor& item_first) {
  TORCH_CHECK(items.dim() == 2 && items.size(1) == ITEM_FIELDS &&
                  items.scalar_type() == at::kInt && items.is_contiguous(),
              "attention: items must be contiguous int32 [I, 6]");
  TORCH_CHECK(item_rows.scalar_type() == at::kInt && item_rows.is_contiguous(),
              "attention: item_rows must be contiguous int32");
  TORCH_CHECK(!item_first.numel() ||
                  (item_first.scalar_type() == at::kInt && item_first.is_contiguous() &&
                   item_first.numel() == item_rows.numel()),
              "attention: item_first must be empty or contiguous int32 like item_rows");
  StepTensors step{items.data_ptr<int32_t>(), items.size(0), item_rows.data_ptr<int32_t>(),
                   item_first.numel() ? item_first.data_ptr<int32_t>() : nullptr, {}, {}};
  for (const at::Tensor& table : tables) {
    TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kInt && table.is_contiguous(),
                "attention: tables must be contiguous int32 [S, W]");
    step.tables.push_back(table.data_ptr<int32_t>());
    step.table_widths.push_back(table.size(1));
  }
  return step;
}

template <typename T>
AttentionArgs<T> attention_args(const StepTensors& step, const T* q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, int64_t heads, double scale) {
  return {step, q, data_of<const T>(k_cache), data_of<const T>(v_cache), heads,
          k_cache.size(0), k_cache.size(1), k_cache.size(2), k_cache.size(3),
          static_cast<float>(scale)};
}

void check_caches(at::ScalarType dtype, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "attention: caches must be contiguous 4-D tensors");
  TORCH_CHECK(dtype == k_cache.scalar_type() && dtype == v_cache.scalar_type(),
              "attention: the activations and the caches must share a dtype");
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2),
              "attention: k_cache and v_cache shapes disagree");
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const std::vector<at::Tensor>& tables,
                           const at::Tensor& items, const at::Tensor& item_rows,
                           const at::Tensor& item_first, double scale, int64_t split_keys) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_attention: q must be contiguous [T, H, D]");
  check_caches(q.scalar_type(), k_cache, v_cache);
  TORCH_CHECK(q.size(2) == k_cache.size(2), "paged_attention: q and cache head_dim disagree");
  // split_keys 0 or negative: batch-invariant (see AttentionPlan)
  const int64_t tokens = q.size(0), heads = q.size(1);
  TORCH_CHECK(heads % k_cache.size(0) == 0, "paged_attention: heads % kv_heads != 0");
  const StepTensors step = step_tensors(tables, items, item_rows, item_first);
  const AttentionPlan plan =
      plan_attention(step, tokens, heads, k_cache.size(0), k_cache.size(3), split_keys);
  at::Tensor out = at::empty_like(q);
  Partials partials;
  dispatch_dtype(q, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto a = attention_args(step, data_of<const T>(q), k_cache, v_cache, heads, scale);
    run_attention(a, plan, partials, tokens, data_of<T>(out));
  }, "paged_attention: float32 or bfloat16 only");
  return out;
}

// ------------------------------------------------------------------ decoder forward
//
// The native model's decoder layers and final norm in one call (decode steps spend a
// third of their time between ops otherwise). Same arithmetic as the Python forward
// (llama.py, fused.py: Hugging Face's): RMSNorm in fp32 rounded to the model dtype, then
// times the weight; residual adds, RoPE products and sums, SiLU and its product each
// rounded to the model dtype (no fused multiply-adds there, as eager torch); linears
// through the packed kernel; the attention above. Every GEMM of the step must be the packed
// one (the caller checks GemmChoice).

template <typename T>
ALWAYS_INLINE float round_to(float value) {
  T stored;
  store_float(&stored, value);
  return load_float(&stored);
}

// one token: h += d (rounded; skipped when d is null); out = rms_norm(h) * weight. Not
// inlined, so that the same machine code runs a row whether at::parallel_for runs the rows
// serially or on its threads (batch invariance; see NO_CONTRACT below).
template <typename T>
__attribute__((noinline)) void add_rms_norm_row(T* h, const T* d, const T* weight, T* out,
                                                int64_t size, float eps) {
  if (d) {
    for (int64_t i = 0; i < size; ++i) store_float(h + i, load_float(h + i) + load_float(d + i));
  }
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < size; ++i) {
    const float x = load_float(h + i);
    squares += x * x;
  }
  const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(size) + eps);
  for (int64_t i = 0; i < size; ++i) {
    const float x = round_to<T>(load_float(h + i) * inverse);
    store_float(out + i, load_float(weight + i) * x);
  }
}

// hidden += delta (rounded; skipped when delta is null); normed = rms_norm(hidden) * weight
template <typename T>
void add_rms_norm_rows(
    T* hidden, const T* delta, const T* weight, T* normed, int64_t rows, int64_t size,
    float eps) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, size));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      add_rms_norm_row<T>(hidden + t * size, delta ? delta + t * size : nullptr, weight,
                          normed + t * size, size, eps);
  });
}

// Eager torch rounds each product before adding (no fused multiply-adds): these rows are
// compiled with fp-contract off. The attribute is on the per-row functions themselves, not on
// their callers: a lambda handed to at::parallel_for is a function of its own, compiled
// without its enclosing function's attribute when it runs on the pool's threads (it is only
// inlined when the work runs serially), which made a row's bits depend on the row count.
#define NO_CONTRACT __attribute__((noinline, optimize("fp-contract=off")))

// one token's q/k/v: per-head RMSNorm of q and k when their weights are given (Qwen3), then
// HF's rotate_half RoPE; x: scratch of dim floats
template <typename T>
NO_CONTRACT void qkv_rope_row(const T* row, const T* c, const T* s, const T* q_norm,
                              const T* k_norm, float eps, T* q, T* k, T* v, int64_t heads,
                              int64_t kv_heads, int64_t dim, float* x) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads + kv_heads; ++h) {
    const bool is_q = h < heads;
    const T* src = row + h * dim;
    const T* norm = is_q ? q_norm : k_norm;
    T* dst = is_q ? q + h * dim : k + (h - heads) * dim;
    for (int64_t d = 0; d < dim; ++d) x[d] = load_float(src + d);
    if (norm) {
      float squares = 0.0f;
      for (int64_t d = 0; d < dim; ++d) squares += x[d] * x[d];
      const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
      for (int64_t d = 0; d < dim; ++d)
        x[d] = round_to<T>(load_float(norm + d) * round_to<T>(x[d] * inverse));
    }
    for (int64_t d = 0; d < dim; ++d) {
      const float rotated = d < half ? -x[d + half] : x[d - half];
      const float a = round_to<T>(x[d] * load_float(c + d));
      const float b = round_to<T>(rotated * load_float(s + d));
      store_float(dst + d, a + b);
    }
  }
  std::memcpy(v, row + (heads + kv_heads) * dim, kv_heads * dim * sizeof(T));
}

// qkv [T, (heads + 2 kv_heads) dim] -> q [T, heads, dim], k, v [T, kv_heads, dim]
template <typename T>
void qkv_rope_rows(const T* qkv, const T* cos, const T* sin, const T* q_norm, const T* k_norm,
                   float eps, T* q, T* k, T* v, int64_t rows, int64_t heads, int64_t kv_heads,
                   int64_t dim) {
  const int64_t width = (heads + 2 * kv_heads) * dim;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> x(dim);
    for (int64_t t = begin; t < end; ++t)
      qkv_rope_row<T>(qkv + t * width, cos + t * dim, sin + t * dim, q_norm, k_norm, eps,
                      q + t * heads * dim, k + t * kv_heads * dim, v + t * kv_heads * dim,
                      heads, kv_heads, dim, x.data());
  });
}

// one token's SiLU(gate) * up over size values
template <typename T>
NO_CONTRACT void silu_mul_row(const T* gate, const T* up, T* dst, int64_t size) {
  int64_t i = 0;
#if defined(HAVE_EXP8)
  if constexpr (std::is_same_v<T, float>) {  // GCC leaves the loop below scalar on AVX2
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= size; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp_any8(_mm256_xor_ps(g, sign))));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
  }
#endif
  const int64_t first = i;
#pragma omp simd
  for (int64_t k = first; k < size; ++k) {
    const float g = load_float(gate + k);
    const float silu = round_to<T>(g / (1.0f + exp_any(-g)));
    store_float(dst + k, silu * load_float(up + k));
  }
}

// gate_up [T, 2 I] (gate, then up) -> SiLU(gate) * up [T, I]
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t size) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, size));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      silu_mul_row<T>(gate_up + t * 2 * size, gate_up + t * 2 * size + size, out + t * size, size);
  });
}

enum LayerTensor {
  INPUT_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM, O_PROJ, O_BIAS, POST_NORM, GATE_UP, DOWN,
  LAYER_TENSORS
};
enum TimedKind { LINEAR_SECONDS, ATTENTION_SECONDS, KV_STORE_SECONDS, ELEMENTWISE_SECONDS };

template <typename T>
const T* optional_data(const at::Tensor& t) {  // null for an empty tensor
  return t.numel() ? data_of<const T>(t) : nullptr;
}

template <typename T>
at::Tensor decoder_forward_impl(const at::Tensor& embedded, const at::Tensor& cos,
                                const at::Tensor& sin, const std::vector<at::Tensor>& layers,
                                const at::Tensor& final_norm,
                                const std::vector<at::Tensor>& k_caches,
                                const std::vector<at::Tensor>& v_caches,
                                const at::Tensor& slot_mapping, const StepTensors& step,
                                int64_t heads, int64_t kv_heads, int64_t intermediate,
                                double eps, double scale, int64_t split_keys, double* seconds,
                                at::Tensor& workspace) {
  const int64_t tokens = embedded.size(0), hidden_size = embedded.size(1);
  const int64_t dim = k_caches[0].size(2), block_size = k_caches[0].size(3);
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  const int64_t qkv_size = (heads + 2 * kv_heads) * dim;
  // The step's activations live in `workspace` (grown here when too small, kept by the
  // caller between steps): fresh buffers of a long prefill chunk cost more in page faults
  // than the arithmetic on them. Only the returned hidden states are a new tensor.
  const auto options = embedded.options();
  const int64_t per_token =  // the buffers carved below
      2 * hidden_size + qkv_size + 2 * heads * dim + 2 * kv_heads * dim + 3 * intermediate;
  const int64_t needed = tokens * per_token * static_cast<int64_t>(sizeof(T));
  if (workspace.numel() < needed) workspace.resize_({needed});
  auto carve = [&, cursor = reinterpret_cast<T*>(workspace.data_ptr())](int64_t width) mutable {
    return std::exchange(cursor, cursor + tokens * width);  // the next tokens * width values
  };
  T* r = carve(hidden_size);  // the residual stream
  T* dl = carve(hidden_size);  // a block's output, added to the stream in the next norm
  T* qkv = carve(qkv_size);
  T* q = carve(heads * dim);
  T* k = carve(kv_heads * dim);
  T* v = carve(kv_heads * dim);
  T* attended = carve(heads * dim);
  T* gate_up = carve(2 * intermediate);
  T* activated = carve(intermediate);
  std::memcpy(r, embedded.data_ptr(), tokens * hidden_size * sizeof(T));
  at::Tensor normed = at::empty({tokens, hidden_size}, options);
  std::vector<float> x32;  // a linear's input in fp32
  std::vector<float> bias32;
  T* n = data_of<T>(normed);
  const float epsf = static_cast<float>(eps);
  auto timed = [&](int kind, auto&& work) {  // work(), its seconds added to seconds[kind]
    const auto started = std::chrono::steady_clock::now();
    work();
    const auto elapsed = std::chrono::steady_clock::now() - started;
    if (seconds) seconds[kind] += std::chrono::duration<double>(elapsed).count();
  };
  std::vector<uint32_t> x_pairs;
  auto linear = [&](const T* x, int64_t in_features, const at::Tensor& packed,
                    const at::Tensor& bias, T* out, int64_t out_features) {
    timed(LINEAR_SECONDS, [&] {
      const float* b = nullptr;
      if (bias.numel()) {
        bias32.resize(out_features);
        const T* raw = data_of<const T>(bias);
        for (int64_t i = 0; i < out_features; ++i) bias32[i] = load_float(raw + i);
        b = bias32.data();
      }
      run_linear<T>(x, tokens, in_features, packed, b, out, out_features, x32, x_pairs);
    });
  };
  auto norm = [&](const T* delta, const at::Tensor& weight) {  // r += delta; n = norm(r)
    timed(ELEMENTWISE_SECONDS, [&] {
      add_rms_norm_rows<T>(r, delta, data_of<const T>(weight), n, tokens, hidden_size, epsf);
    });
  };
  const AttentionPlan plan = plan_attention(step, tokens, heads, kv_heads, block_size, split_keys);
  Partials partials;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = layers.data() + layer * LAYER_TENSORS;
    norm(layer ? dl : nullptr, w[INPUT_NORM]);
    linear(n, hidden_size, w[QKV], w[QKV_BIAS], qkv, qkv_size);
    timed(ELEMENTWISE_SECONDS, [&] {
      qkv_rope_rows<T>(qkv, data_of<const T>(cos), data_of<const T>(sin),
                       optional_data<T>(w[Q_NORM]), optional_data<T>(w[K_NORM]), epsf, q, k, v,
                       tokens, heads, kv_heads, dim);
    });
    timed(KV_STORE_SECONDS, [&] {
      store_kv_impl<T>(data_of<T>(k_caches[layer]), data_of<T>(v_caches[layer]), k, v, slots,
                       tokens, kv_heads, k_caches[layer].size(1), dim, block_size);
    });
    timed(ATTENTION_SECONDS, [&] {
      auto a = attention_args<T>(step, q, k_caches[layer], v_caches[layer], heads, scale);
      run_attention(a, plan, partials, tokens, attended);
    });
    linear(attended, heads * dim, w[O_PROJ], w[O_BIAS], dl, hidden_size);
    norm(dl, w[POST_NORM]);
    linear(n, hidden_size, w[GATE_UP], at::Tensor(), gate_up, 2 * intermediate);
    timed(ELEMENTWISE_SECONDS, [&] { silu_mul_rows<T>(gate_up, activated, tokens, intermediate); });
    linear(activated, intermediate, w[DOWN], at::Tensor(), dl, hidden_size);
  }
  norm(num_layers ? dl : nullptr, final_norm);
  return normed;
}

// The elementwise regions on their own (the tests compare them with fused.py's eager ones).
std::vector<at::Tensor> add_rms_norm(const at::Tensor& hidden, const at::Tensor& delta,
                                     const at::Tensor& weight, double eps) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && weight.is_contiguous() &&
                  weight.numel() == hidden.size(1) &&
                  weight.scalar_type() == hidden.scalar_type(),
              "add_rms_norm: hidden [T, size], weight [size], contiguous, one dtype");
  TORCH_CHECK(!delta.numel() || (delta.sizes() == hidden.sizes() && delta.is_contiguous() &&
                                 delta.scalar_type() == hidden.scalar_type()),
              "add_rms_norm: delta must be like hidden (or empty)");
  at::Tensor summed = hidden.clone(), normed = at::empty_like(hidden);
  dispatch_dtype(hidden, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    add_rms_norm_rows<T>(data_of<T>(summed), optional_data<T>(delta), data_of<T>(weight),
                         data_of<T>(normed), hidden.size(0), hidden.size(1),
                         static_cast<float>(eps));
  }, "add_rms_norm: float32 or bfloat16 only");
  return {summed, normed};
}

std::vector<at::Tensor> qkv_rope(const at::Tensor& qkv, const at::Tensor& cos,
                                 const at::Tensor& sin, const at::Tensor& q_norm,
                                 const at::Tensor& k_norm, double eps, int64_t heads,
                                 int64_t kv_heads, int64_t dim) {
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * dim &&
                  qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.size(0) == tokens && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "qkv_rope: qkv [T, (heads + 2 kv_heads) dim], cos/sin [T, dim], contiguous");
  at::Tensor q = at::empty({tokens, heads, dim}, qkv.options());
  at::Tensor k = at::empty({tokens, kv_heads, dim}, qkv.options());
  at::Tensor v = at::empty({tokens, kv_heads, dim}, qkv.options());
  dispatch_dtype(qkv, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    qkv_rope_rows<T>(data_of<T>(qkv), data_of<T>(cos), data_of<T>(sin),
                     optional_data<T>(q_norm), optional_data<T>(k_norm), static_cast<float>(eps),
                     data_of<T>(q), data_of<T>(k), data_of<T>(v), tokens, heads, kv_heads, dim);
  }, "qkv_rope: float32 or bfloat16 only");
  return {q, k, v};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous(),
              "silu_mul: gate_up must be contiguous [T, 2 I]");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_dtype(gate_up, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_rows<T>(data_of<T>(gate_up), data_of<T>(out), gate_up.size(0), out.size(1));
  }, "silu_mul: float32 or bfloat16 only");
  return out;
}

// embedded [T, hidden] (the token embeddings), cos/sin [T, head_dim]; layers: LAYER_TENSORS
// per layer (packed projections; empty tensors for absent biases and q/k norms); the
// step's cache slots and attention items. seconds: float64 [4] accumulating (linear,
// attention, kv store, elementwise) seconds, or an empty tensor; workspace: a uint8 tensor
// for the step's activations, resized here when too small. -> final-normed hidden.
at::Tensor decoder_forward(const at::Tensor& embedded, const at::Tensor& cos,
                           const at::Tensor& sin, const std::vector<at::Tensor>& layers,
                           const at::Tensor& final_norm, const std::vector<at::Tensor>& k_caches,
                           const std::vector<at::Tensor>& v_caches,
                           const at::Tensor& slot_mapping, const std::vector<at::Tensor>& tables,
                           const at::Tensor& items, const at::Tensor& item_rows,
                           const at::Tensor& item_first, int64_t heads, int64_t kv_heads,
                           int64_t intermediate, double eps, double scale,
                           int64_t split_keys, at::Tensor& seconds, at::Tensor& workspace) {
  TORCH_CHECK(embedded.dim() == 2 && embedded.is_contiguous(),
              "decoder_forward: embedded must be contiguous [T, hidden]");
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(num_layers >= 1 && static_cast<int64_t>(v_caches.size()) == num_layers &&
                  static_cast<int64_t>(layers.size()) == num_layers * LAYER_TENSORS,
              "decoder_forward: ", LAYER_TENSORS, " tensors and one K and V cache per layer");
  const int64_t tokens = embedded.size(0);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == tokens && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == embedded.scalar_type(),
              "decoder_forward: cos and sin must be contiguous [T, head_dim] in the model dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == tokens,
              "decoder_forward: slot_mapping must be int64 [T]");
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    check_caches(embedded.scalar_type(), k_caches[layer], v_caches[layer]);
    TORCH_CHECK(k_caches[layer].size(0) == kv_heads && heads % kv_heads == 0 &&
                    cos.size(1) == k_caches[layer].size(2),
                "decoder_forward: head shapes disagree with the caches");
    for (int i = 0; i < LAYER_TENSORS; ++i) {
      const at::Tensor& t = layers[layer * LAYER_TENSORS + i];
      const bool projection = i == QKV || i == O_PROJ || i == GATE_UP || i == DOWN;
      TORCH_CHECK(!t.numel() || (t.is_contiguous() && (t.scalar_type() == embedded.scalar_type() ||
                                                       (projection && is_quantized(t)))),
                  "decoder_forward: layer ", layer, " tensor ", i,
                  " must be contiguous in the model dtype");
    }
  }
  const int64_t hidden_size = embedded.size(1), dim = cos.size(1);
  for (int64_t layer = 0; layer < num_layers; ++layer) {  // projections fit the shapes
    const at::Tensor* w = layers.data() + layer * LAYER_TENSORS;
    const std::pair<int, std::pair<int64_t, int64_t>> shapes[] = {
        {QKV, {(heads + 2 * kv_heads) * dim, hidden_size}},
        {O_PROJ, {hidden_size, heads * dim}},
        {GATE_UP, {2 * intermediate, hidden_size}},
        {DOWN, {hidden_size, intermediate}}};
    for (const auto& [index, shape] : shapes) {
      const at::Tensor& packed = w[index];
      TORCH_CHECK((packed.dim() == 3 || packed.dim() == 4) &&
                      packed.size(0) == (shape.first + LANES - 1) / LANES &&
                      packed_in_features(packed) == shape.second + (is_pairs(packed) ? shape.second % 2 : 0),
                  "decoder_forward: layer ", layer, " projection ", index,
                  " is not a packed [", shape.first, ", ", shape.second, "] weight");
    }
  }
  TORCH_CHECK(workspace.scalar_type() == at::kByte && workspace.dim() == 1 &&
                  workspace.is_contiguous(),
              "decoder_forward: workspace must be a 1-D uint8 tensor (grown as needed)");
  const StepTensors step = step_tensors(tables, items, item_rows, item_first);
  double* timings = nullptr;
  if (seconds.numel()) {
    TORCH_CHECK(seconds.scalar_type() == at::kDouble && seconds.numel() == 4,
                "decoder_forward: seconds must be float64 [4] or empty");
    timings = seconds.data_ptr<double>();
  }
  at::Tensor normed;
  dispatch_dtype(embedded, [&](auto* tag) {
    normed = decoder_forward_impl<std::remove_pointer_t<decltype(tag)>>(
        embedded, cos, sin, layers, final_norm, k_caches, v_caches, slot_mapping, step, heads,
        kv_heads, intermediate, eps, scale, split_keys, timings, workspace);
  }, "decoder_forward: float32 or bfloat16");
  return normed;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_linear_weight", &pack_linear_weight, "W [N, K] packed for packed_linear");
  m.def("packed_linear", &packed_linear, "x @ W^T (+ bias) with W from pack_linear_weight");
  m.def("quantized_linear_reference", &quantized_linear_reference,
        "x @ W^T for a quantized packed W, in the scalar reference arithmetic");
  m.def("store_kv", &store_kv, "write K/V into the CPU cache layout");
  m.def("paged_attention", &paged_attention, "shared-prefix paged attention, merged");
  m.def("decoder_forward", &decoder_forward, "the decoder layers and final norm in one call");
  m.def("add_rms_norm", &add_rms_norm, "(hidden + delta, rms_norm(hidden + delta) * weight)");
  m.def("qkv_rope", &qkv_rope, "split qkv, [q/k RMSNorm,] RoPE: (q, k, v)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
}

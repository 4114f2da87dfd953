// Compiled CPU kernels of the native engine (built once per machine by cpu_build.py).
//
// Three operations, each with a torch reference that is its fallback and its test oracle:
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
//   k_cache [num_blocks, num_kv_heads, head_dim, block_size]   K transposed per block, so
//           16 keys of one dimension are one vector (scores for 16 keys = FMAs, no shuffles)
//   v_cache [num_blocks, num_kv_heads, block_size, head_dim]
//
// Plain C++ loops over 16 lanes with `omp simd`: the compiler (-O3 -march=native) turns them
// into AVX-512 or AVX2 code. Floats are fp32 or bf16 (raw uint16 bits); arithmetic is fp32.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int LANES = 16;  // one 512-bit vector of fp32
// Rows of x (linear) or query vectors (attention) sharing one weight or key load: their
// accumulators must fit the vector registers (32 with AVX-512; 16 with AVX2, where a
// 16-lane vector takes two). 16 rows a tile measured slower than 8 with AVX-512.
#if defined(__AVX512F__)
constexpr int LINEAR_TILE = 8;
constexpr int TILE_QUERIES = 8;
#else
constexpr int LINEAR_TILE = 4;
constexpr int TILE_QUERIES = 4;
#endif
// case n: for n = 1..16, as a statement list (dispatch to a template of a tile size)
#define FOR_TILE_SIZES(CASE) \
  CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) \
  CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

using bf16_bits = uint16_t;

inline float load_float(const float* p) { return *p; }
inline float load_float(const bf16_bits* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline void store_float(float* p, float value) { *p = value; }
inline void store_float(bf16_bits* p, float value) {
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

// exp(x) for x <= 0 (softmax weights): Cephes' expf reduction and polynomial, branch-free so
// that loops over it vectorize; about 1 ulp. Returns 0 below -87 (and for -inf).
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// 16 fp32 lanes as a GCC vector: one zmm register with AVX-512, two ymm with AVX2. Vector
// types keep accumulators in registers (plain arrays were sometimes spilled to the stack).
typedef float vec16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t vec16_u16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vec16_u32 __attribute__((vector_size(64), aligned(4)));

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vec16 load16(const bf16_bits* p) {
  vec16_u16 half;
  std::memcpy(&half, p, sizeof(half));
  const vec16_u32 bits = __builtin_convertvector(half, vec16_u32) << 16;
  vec16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// ------------------------------------------------------------------ packed linear

// out[m][n0 + j] = sum_k x[m][k] * w[k][j] (+ bias[n0 + j]) for one 16-column block
// w [K][16], M rows of x and the block's first `width` columns.
template <int M, typename W, typename T>
inline void linear_block(const float* __restrict x, int64_t K, const W* __restrict w,
                         const float* bias, int64_t n0, int width, T* __restrict out, int64_t N) {
  vec16 sums[M];
  for (int m = 0; m < M; ++m) sums[m] = vec16{};
  for (int64_t k = 0; k < K; ++k) {
    const vec16 weights = load16(w + k * LANES);
    for (int m = 0; m < M; ++m) sums[m] += x[m * K + k] * weights;
  }
  for (int m = 0; m < M; ++m) {
    float row[LANES];
    store16(row, sums[m]);
    T* dst = out + m * N + n0;
    for (int j = 0; j < width; ++j) store_float(dst + j, bias ? row[j] + bias[n0 + j] : row[j]);
  }
}

template <typename W, typename T>
void linear_rows(int rows, const float* x, int64_t K, const W* w, const float* bias,
                 int64_t n0, int width, T* out, int64_t N) {
  switch (rows) {
#define LINEAR_CASE(n)                                                    \
  case n:                                                                 \
    if constexpr (n <= LINEAR_TILE) linear_block<n>(x, K, w, bias, n0, width, out, N); \
    break;
    FOR_TILE_SIZES(LINEAR_CASE)
#undef LINEAR_CASE
    default: TORCH_CHECK(false, "linear_rows: rows must be 1..", LINEAR_TILE);
  }
}

template <typename T>
void packed_linear_impl(const float* x, int64_t M, int64_t K, const T* packed, int64_t blocks,
                        const float* bias, T* out, int64_t N) {
  // Each task takes whole 16-column blocks; a block's weights (K * 16 values) are read once
  // from memory and reused from cache by every tile of 8 rows.
  const int64_t block_bytes = K * LANES * static_cast<int64_t>(sizeof(T));
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, block_bytes * M));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const T* w = packed + block * K * LANES;
      const int64_t n0 = block * LANES;
      const int width = static_cast<int>(std::min<int64_t>(LANES, N - n0));
      for (int64_t m0 = 0; m0 < M; m0 += LINEAR_TILE) {
        const int rows = static_cast<int>(std::min<int64_t>(LINEAR_TILE, M - m0));
        linear_rows(rows, x + m0 * K, K, w, bias, n0, width, out + m0 * N, N);
      }
    }
  });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2, "packed_linear: x must be [rows, in_features], got ", x.sizes());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == LANES,
              "packed_linear: packed must be [blocks, in_features, 16], got ", packed.sizes());
  TORCH_CHECK(packed.is_contiguous(), "packed_linear: packed must be contiguous");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "packed_linear: x is ", x.scalar_type(),
              " but packed is ", packed.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "packed_linear: x has ", K, " features, packed ",
              packed.size(1));
  TORCH_CHECK(out_features > (blocks - 1) * LANES && out_features <= blocks * LANES,
              "packed_linear: out_features ", out_features, " does not fit ", blocks, " blocks");
  at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features,
                "packed_linear: bias must be [out_features]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, out_features}, x.options());
  if (M == 0) return out;
  const float* bias_ptr = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    packed_linear_impl<float>(x32.data_ptr<float>(), M, K, packed.data_ptr<float>(), blocks,
                              bias_ptr, out.data_ptr<float>(), out_features);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "packed_linear: float32 or bfloat16, got ",
                x.scalar_type());
    packed_linear_impl<bf16_bits>(x32.data_ptr<float>(), M, K,
                                  reinterpret_cast<const bf16_bits*>(packed.data_ptr()), blocks,
                                  bias_ptr, reinterpret_cast<bf16_bits*>(out.data_ptr()),
                                  out_features);
  }
  return out;
}

// ------------------------------------------------------------------ K/V store

template <typename T>
void store_kv_impl(T* k_cache, T* v_cache, const T* k, const T* v, const int64_t* slots,
                   int64_t tokens, int64_t kv_heads, int64_t dim, int64_t block_size) {
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t g = 0; g < kv_heads; ++g) {
      const T* k_row = k + (t * kv_heads + g) * dim;
      const T* v_row = v + (t * kv_heads + g) * dim;
      T* k_block = k_cache + (block * kv_heads + g) * dim * block_size + offset;
      T* v_block = v_cache + ((block * kv_heads + g) * block_size + offset) * dim;
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
  const int64_t kv_heads = k_cache.size(1), dim = k_cache.size(2), block_size = k_cache.size(3);
  const int64_t tokens = k.size(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  if (k_cache.scalar_type() == at::kFloat) {
    store_kv_impl<float>(k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         k.data_ptr<float>(), v.data_ptr<float>(), slots, tokens, kv_heads, dim,
                         block_size);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16, "store_kv: float32 or bfloat16 only");
    store_kv_impl<bf16_bits>(reinterpret_cast<bf16_bits*>(k_cache.data_ptr()),
                             reinterpret_cast<bf16_bits*>(v_cache.data_ptr()),
                             reinterpret_cast<const bf16_bits*>(k.data_ptr()),
                             reinterpret_cast<const bf16_bits*>(v.data_ptr()), slots, tokens,
                             kv_heads, dim, block_size);
  }
}

// ------------------------------------------------------------------ paged attention

// items [I, 6] int32: (table list index, table row, key_len, row_begin, row_count, causal).
// Item i: the q rows item_rows[row_begin : row_begin + row_count] attend to key_len keys at
// the blocks tables[list][row]; causal: its row r sits at position key_len - row_count + r
// and sees keys 0 .. that position; else every row sees all key_len keys.
enum ItemField { TABLE_LIST, TABLE_ROW, KEY_LEN, ROW_BEGIN, ROW_COUNT, CAUSAL, ITEM_FIELDS };

struct Unit {  // one item's rows [r0, r1), one KV head, keys [k0, k1)
  int64_t item, head, r0, r1, k0, k1;
  int64_t entry;  // first partial-result entry: (r1 - r0) * group of them, row-major
};

struct Partials {  // unnormalized partial softmax results, one entry per (unit row, head)
  std::vector<float> acc;  // [entries, dim]
  std::vector<float> max;  // [entries]
  std::vector<float> sum;  // [entries]
};

// Scores of up to 8 query vectors q [n][dim] against 16 keys kt [dim][stride]:
// scores[i * score_stride + j] for lanes j = 0..15.
template <int N, typename T>
inline void score_tile(const float* __restrict q, int64_t dim, const T* __restrict kt,
                       int64_t stride, float* __restrict scores, int64_t score_stride) {
  vec16 sums[N];
  for (int i = 0; i < N; ++i) sums[i] = vec16{};
  for (int64_t d = 0; d < dim; ++d) {
    const vec16 keys = load16(kt + d * stride);
    for (int i = 0; i < N; ++i) sums[i] += q[i * dim + d] * keys;
  }
  for (int i = 0; i < N; ++i) store16(scores + i * score_stride, sums[i]);
}

template <typename T>
void score_rows(int n, const float* q, int64_t dim, const T* kt, int64_t stride, float* scores,
                int64_t score_stride) {
  switch (n) {
#define SCORE_CASE(c)                                                                \
  case c:                                                                            \
    if constexpr (c <= TILE_QUERIES) score_tile<c>(q, dim, kt, stride, scores, score_stride); \
    break;
    FOR_TILE_SIZES(SCORE_CASE)
#undef SCORE_CASE
    default: TORCH_CHECK(false, "score_rows: 1..", TILE_QUERIES, " query vectors");
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
    vec16 sums[N];
    for (int i = 0; i < N; ++i) sums[i] = load16(acc + i * dim + d0) * correction[i];
    for (int j = 0; j < keys; ++j) {
      const vec16 values = load16(v + j * dim + d0);
      for (int i = 0; i < N; ++i) sums[i] += weights[i * weight_stride + j] * values;
    }
    for (int i = 0; i < N; ++i) store16(acc + i * dim + d0, sums[i]);
  }
  for (; d0 < dim; ++d0) {  // a head_dim that is not a multiple of 16
    for (int i = 0; i < N; ++i) {
      float sum = acc[i * dim + d0] * correction[i];
      for (int j = 0; j < keys; ++j)
        sum += weights[i * weight_stride + j] * load_float(v + j * dim + d0);
      acc[i * dim + d0] = sum;
    }
  }
}

template <typename T>
void value_rows(int n, const float* weights, int64_t weight_stride, const float* correction,
                const T* v, int64_t dim, int keys, float* acc) {
  switch (n) {
#define VALUE_CASE(c)                                                                    \
  case c:                                                                                \
    if constexpr (c <= TILE_QUERIES)                                                     \
      value_tile<c>(weights, weight_stride, correction, v, dim, keys, acc);              \
    break;
    FOR_TILE_SIZES(VALUE_CASE)
#undef VALUE_CASE
    default: TORCH_CHECK(false, "value_rows: 1..", TILE_QUERIES, " query vectors");
  }
}

template <typename T>
struct AttentionArgs {
  const T* q;  // [tokens, heads, dim]
  const T* k_cache;
  const T* v_cache;
  int64_t heads, kv_heads, dim, block_size;
  float scale;
  const int32_t* items;
  const int32_t* item_rows;
  std::vector<const int32_t*> tables;
  std::vector<int64_t> table_widths;
};

// Up to SUB_TILES runs of at most 16 keys, each inside one block, form one softmax step.
constexpr int SUB_TILES = 4;
constexpr int STEP_KEYS = SUB_TILES * LANES;

template <typename T>
void run_unit(const AttentionArgs<T>& a, const Unit& u, Partials& out, std::vector<float>& scratch) {
  const int32_t* item = a.items + u.item * ITEM_FIELDS;
  const int64_t group = a.heads / a.kv_heads, dim = a.dim, block_size = a.block_size;
  const int64_t key_len = item[KEY_LEN], row_count = item[ROW_COUNT];
  const bool causal = item[CAUSAL] != 0;
  const int32_t* table =
      a.tables[item[TABLE_LIST]] + item[TABLE_ROW] * a.table_widths[item[TABLE_LIST]];
  const int32_t* rows = a.item_rows + item[ROW_BEGIN];
  const int64_t queries = (u.r1 - u.r0) * group;
  // scratch: q [queries, dim] (scaled), SUB_TILES key tiles [dim, 16], limits [queries],
  // the softmax denominators lane by lane [queries, 16] (summed across lanes at the end)
  scratch.resize(queries * dim + SUB_TILES * dim * LANES + queries + queries * LANES);
  float* q = scratch.data();
  float* key_tiles = q + queries * dim;
  float* limit = key_tiles + SUB_TILES * dim * LANES;
  float* lane_sums = limit + queries;
  std::fill(lane_sums, lane_sums + queries * LANES, 0.0f);
  for (int64_t r = u.r0; r < u.r1; ++r) {
    const T* q_row = a.q + (static_cast<int64_t>(rows[r]) * a.heads + u.head * group) * dim;
    for (int64_t j = 0; j < group; ++j) {
      float* dst = q + ((r - u.r0) * group + j) * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = load_float(q_row + j * dim + d) * a.scale;
      limit[(r - u.r0) * group + j] =
          static_cast<float>(causal ? key_len - row_count + r + 1 : key_len);
    }
  }
  float* acc = out.acc.data() + u.entry * dim;
  float* run_max = out.max.data() + u.entry;
  float* run_sum = out.sum.data() + u.entry;
  std::fill(acc, acc + queries * dim, 0.0f);
  std::fill(run_max, run_max + queries, NEG_INF);
  std::fill(run_sum, run_sum + queries, 0.0f);
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
  for (int64_t k = u.k0; k < visible_end;) {
    int count = 0;
    for (; count < SUB_TILES && k < visible_end; ++count) {
      const int64_t block = table[k / block_size], offset = k % block_size;
      const int width =
          static_cast<int>(std::min<int64_t>({LANES, block_size - offset, visible_end - k}));
      const T* k_block = a.k_cache + (block * a.kv_heads + u.head) * dim * block_size + offset;
      SubTile& tile = tiles[count];
      tile.first = k;
      tile.width = width;
      tile.values = a.v_cache + ((block * a.kv_heads + u.head) * block_size + offset) * dim;
      // Lanes past the tile's width read later slots of the same block row (stale or unwritten
      // keys, masked out of the softmax); a tile that would leave its block row (blocks of
      // fewer than 16 tokens, or not a multiple of 16) is copied, zero-padded, instead.
      tile.copied = offset + LANES > block_size;
      if (tile.copied) {
        float* copy = key_tiles + count * dim * LANES;
        for (int64_t d = 0; d < dim; ++d)
          for (int j = 0; j < LANES; ++j)
            copy[d * LANES + j] = j < width ? load_float(k_block + d * block_size + j) : 0.0f;
        tile.keys = copy;
        tile.stride = LANES;
      } else {
        tile.keys = k_block;
        tile.stride = block_size;
      }
      k += width;
    }
    // start loading the next step's keys and values while this one computes
    for (int64_t next = k, t = 0; next < visible_end && t < SUB_TILES; ++t) {
      const int64_t block = table[next / block_size], offset = next % block_size;
      const int64_t width = std::min<int64_t>({LANES, block_size - offset, visible_end - next});
      const char* k_bytes = reinterpret_cast<const char*>(
          a.k_cache + (block * a.kv_heads + u.head) * dim * block_size + offset);
      const char* v_bytes = reinterpret_cast<const char*>(
          a.v_cache + ((block * a.kv_heads + u.head) * block_size + offset) * dim);
      for (int64_t d = 0; d < dim; ++d)
        __builtin_prefetch(k_bytes + d * block_size * sizeof(T));
      for (int64_t line = 0; line < int64_t(width * dim * sizeof(T)); line += 64)
        __builtin_prefetch(v_bytes + line);
      next += width;
    }
    for (int64_t i0 = 0; i0 < queries; i0 += TILE_QUERIES) {
      const int n = static_cast<int>(std::min<int64_t>(TILE_QUERIES, queries - i0));
      for (int t = 0; t < count; ++t) {
        if (tiles[t].copied)
          score_rows<float>(n, q + i0 * dim, dim, static_cast<const float*>(tiles[t].keys),
                            tiles[t].stride, scores[0] + t * LANES, STEP_KEYS);
        else
          score_rows<T>(n, q + i0 * dim, dim, static_cast<const T*>(tiles[t].keys),
                        tiles[t].stride, scores[0] + t * LANES, STEP_KEYS);
      }
      // online softmax per query over the keys it sees in this step (a prefix of each tile)
      int keys[SUB_TILES] = {0, 0, 0, 0};
      for (int i = 0; i < n; ++i) {
        const int64_t query = i0 + i;
        const int64_t query_limit = static_cast<int64_t>(limit[query]);
        int valid[SUB_TILES];
        float lane_max[LANES];
        for (int j = 0; j < LANES; ++j) lane_max[j] = NEG_INF;
        for (int t = 0; t < count; ++t) {
          valid[t] = static_cast<int>(std::max<int64_t>(
              0, std::min<int64_t>(tiles[t].width, query_limit - tiles[t].first)));
          const float* row = scores[i] + t * LANES;
          const int v = valid[t];
#pragma omp simd
          for (int j = 0; j < LANES; ++j) lane_max[j] = std::max(lane_max[j], j < v ? row[j] : NEG_INF);
        }
        float step_max = NEG_INF;
#pragma omp simd reduction(max : step_max)
        for (int j = 0; j < LANES; ++j) step_max = std::max(step_max, lane_max[j]);
        const float new_max = std::max(run_max[query], step_max);
        if (new_max == NEG_INF) {  // sees no key yet: nothing changes
          correction[i] = 1.0f;
          std::fill(weights[i], weights[i] + STEP_KEYS, 0.0f);
          continue;
        }
        const float c = exp_nonpositive(run_max[query] - new_max);
        correction[i] = c;
        run_max[query] = new_max;
        float* sums = lane_sums + query * LANES;
        float step_sums[LANES];
        for (int j = 0; j < LANES; ++j) step_sums[j] = sums[j] * c;
        for (int t = 0; t < count; ++t) {
          const float* row = scores[i] + t * LANES;
          float* w = weights[i] + t * LANES;
          const int v = valid[t];
#pragma omp simd
          for (int j = 0; j < LANES; ++j) {
            const float e = j < v ? exp_nonpositive(row[j] - new_max) : 0.0f;
            w[j] = e;
            step_sums[j] += e;
          }
          keys[t] = std::max(keys[t], v);
        }
        for (int j = 0; j < LANES; ++j) sums[j] = step_sums[j];
      }
      // keys past a query's limit weigh 0 but are real (written) keys of this item
      for (int t = 0; t < count; ++t) {
        if (keys[t] > 0)
          value_rows<T>(n, weights[0] + t * LANES, STEP_KEYS, t == 0 ? correction : ones,
                        tiles[t].values, dim, keys[t], acc + i0 * dim);
        else if (t == 0)
          value_rows<T>(n, weights[0], STEP_KEYS, correction, tiles[0].values, dim, 0,
                        acc + i0 * dim);
      }
    }
  }
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

template <typename T>
void paged_attention_impl(const AttentionArgs<T>& a, int64_t num_items, int64_t tokens,
                          int64_t split_keys, T* out) {
  const int64_t group = a.heads / a.kv_heads;
  // A unit takes up to 256 query vectors (rows x the query heads of one KV head) and reads
  // each key once for all of them. An item that fits one such tile (decode rows, short
  // chunks) is also cut into key chunks of split_keys, so few rows over a long prefix still
  // spread over the threads; a longer item (a prefill chunk) is cut into row tiles instead.
  const int64_t tile_rows = std::max<int64_t>(1, 256 / group);
  std::vector<Unit> units;
  int64_t entries = 0;
  for (int64_t i = 0; i < num_items; ++i) {
    const int32_t* item = a.items + i * ITEM_FIELDS;
    const int64_t key_len = item[KEY_LEN], row_count = item[ROW_COUNT];
    if (key_len <= 0 || row_count <= 0) continue;
    for (int64_t r0 = 0; r0 < row_count; r0 += tile_rows) {
      const int64_t r1 = std::min(row_count, r0 + tile_rows);
      const int64_t visible = item[CAUSAL] ? key_len - row_count + r1 : key_len;
      const int64_t chunk = row_count <= tile_rows ? split_keys : visible;
      for (int64_t k0 = 0; k0 < visible; k0 += chunk) {
        for (int64_t g = 0; g < a.kv_heads; ++g) {
          units.push_back({i, g, r0, r1, k0, std::min(visible, k0 + chunk), entries});
          entries += (r1 - r0) * group;
        }
      }
    }
  }
  Partials partials;
  partials.acc.resize(entries * a.dim);
  partials.max.resize(entries);
  partials.sum.resize(entries);
  // the partial entries of each (token, kv head), for the merge
  const int64_t pairs = tokens * a.kv_heads;
  std::vector<int64_t> part_start(pairs + 1, 0);
  for (const Unit& u : units) {
    const int32_t* rows = a.item_rows + a.items[u.item * ITEM_FIELDS + ROW_BEGIN];
    for (int64_t r = u.r0; r < u.r1; ++r) ++part_start[rows[r] * a.kv_heads + u.head + 1];
  }
  for (int64_t p = 0; p < pairs; ++p) part_start[p + 1] += part_start[p];
  std::vector<int64_t> parts(part_start[pairs]);
  std::vector<int64_t> fill(part_start.begin(), part_start.end() - 1);
  for (const Unit& u : units) {
    const int32_t* rows = a.item_rows + a.items[u.item * ITEM_FIELDS + ROW_BEGIN];
    for (int64_t r = u.r0; r < u.r1; ++r)
      parts[fill[rows[r] * a.kv_heads + u.head]++] = u.entry + (r - u.r0) * group;
  }
  const int64_t count = static_cast<int64_t>(units.size());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), count));
  // units differ in size (a long segment, a one-row decode): threads take them as they go
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < count; ++u) run_unit(a, units[u], partials, scratch);
  }
  merge_partials(a, partials, part_start, parts, tokens, out);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const std::vector<at::Tensor>& tables,
                           const at::Tensor& items, const at::Tensor& item_rows, double scale,
                           int64_t split_keys) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_attention: q must be contiguous [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "paged_attention: caches must be contiguous 4-D tensors");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q and the caches must share a dtype");
  TORCH_CHECK(items.dim() == 2 && items.size(1) == ITEM_FIELDS &&
                  items.scalar_type() == at::kInt && items.is_contiguous(),
              "paged_attention: items must be contiguous int32 [I, 6]");
  TORCH_CHECK(item_rows.scalar_type() == at::kInt && item_rows.is_contiguous(),
              "paged_attention: item_rows must be contiguous int32");
  TORCH_CHECK(split_keys >= 1, "paged_attention: split_keys must be >= 1");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == dim && v_cache.size(3) == dim && heads % kv_heads == 0,
              "paged_attention: head shapes disagree");
  at::Tensor out = at::empty_like(q);
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    AttentionArgs<T> a;
    a.q = reinterpret_cast<const T*>(q.data_ptr());
    a.k_cache = reinterpret_cast<const T*>(k_cache.data_ptr());
    a.v_cache = reinterpret_cast<const T*>(v_cache.data_ptr());
    a.heads = heads;
    a.kv_heads = kv_heads;
    a.dim = dim;
    a.block_size = k_cache.size(3);
    a.scale = static_cast<float>(scale);
    a.items = items.data_ptr<int32_t>();
    a.item_rows = item_rows.data_ptr<int32_t>();
    for (const at::Tensor& table : tables) {
      TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kInt && table.is_contiguous(),
                  "paged_attention: tables must be contiguous int32 [S, W]");
      a.tables.push_back(table.data_ptr<int32_t>());
      a.table_widths.push_back(table.size(1));
    }
    paged_attention_impl<T>(a, items.size(0), tokens, split_keys,
                            reinterpret_cast<T*>(out.data_ptr()));
  };
  if (q.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_attention: float32 or bfloat16 only");
    run(static_cast<bf16_bits*>(nullptr));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "x @ W^T with W packed [ceil(N/16), K, 16]");
  m.def("store_kv", &store_kv, "write K/V into the CPU cache layout");
  m.def("paged_attention", &paged_attention, "shared-prefix paged attention, merged");
}

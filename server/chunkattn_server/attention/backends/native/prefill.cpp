// chunkattn's native CPU prefill: every prefill piece of a call (one sequence's queries inside one chunk, see
// attention/plan.py) in one call, a tiled flash loop (online softmax, float32 accumulation) per piece x KV head x
// query tile, the query heads of one KV head as rows of one problem.
//
// Two phases, each over all threads:
// 1. pack: every piece's keys [key_start, position + num_queries), per KV head, in tiles of kN keys, into the
//    GEMM's operand layouts in its input type In (float32, or bfloat16 on the AMX tiles, see below): keys
//    before cache_end read straight from the pages through the piece's blocks (float16 / bfloat16 / float8
//    converted, times the cache's scale), the rest from the call's own k / v rows; a tile's keys past the piece's
//    last are zeros. Each key is converted once for all the piece's query tiles. Pieces are packed in groups
//    whose packed K/V stay under kPackBytes.
// 2. attend: tasks (piece, KV head, query tile of qM queries: qM x G rows, G query heads per KV head), largest
//    first from a shared counter. Per key tile: S = Q K^T (float32), scaled, ALiBi added (slope * (j - i)),
//    masked causally on the diagonal (and only there), online softmax, P (In) V accumulated into float32 O.
//    The tile on the diagonal is cut to the keys its last query sees (rounded up to 32): no work on the masked
//    triangle beyond that.
//
// GEMM engines, chosen by the compute dtype: bfloat16 in the AMX build (where Linux grants this process the
// tiles) on AMX tiles driven here (_tile_dpbf16ps: 32 x 32 blocks of C in four tiles, one configuration for
// both products, K^T and V packed in VNNI layout by blocks of 16 columns so that each tile of B is 1 KiB in one
// piece; Q and P rows padded to whole tiles); everything else (float32, float16 compute, bfloat16 without AMX)
// on BLAS's sgemm in float32 (MKL's, inside torch), operands converted to float32 when packed (float16
// exactly). Threads: at::parallel_for for both phases; phase 2's tasks taken from a shared counter, the largest
// (most keys) first, so a causal piece's long query tiles do not end up on one thread.

#include "amx.h"
#include "pages.h"

#include <ATen/cpu/vec/functional.h>

#include <atomic>
#include <memory>
#include <optional>


extern "C" void sgemm_(char* transa, char* transb, int* m, int* n, int* k, float* alpha, const float* a, int* lda,
                       const float* b, int* ldb, float* beta, float* c, int* ldc);

namespace chunkattn {
namespace {


constexpr int64_t kRows = 128;              // rows (queries x query heads of one KV head) per task, about
constexpr int64_t kN = 256;                 // keys per tile (faster than 128 and 512 here, bfloat16)
// Rows of S, P and O a little longer than a power of two bytes: the rows of a tile load or store then fall
// in different sets of the L1 cache.
constexpr int64_t kLdS = kN + 16, kLdP = kN + 32, kPadO = 16;
constexpr int64_t kRound = 32;              // a cut diagonal tile's keys are a multiple of this
constexpr int64_t kPackBytes = 64 << 20;    // packed K/V of one group of pieces, at most (one piece: any size)
static_assert(kN % kRound == 0 && kRound % 16 == 0, "tiles are read in whole vectors");

// One piece, from the caller's metadata.
struct Piece {
  int64_t row, nq, position, key_start, cache_end, block_off;
  int64_t keys() const { return position + nq - key_start; }
  int64_t tiles() const { return (keys() + kN - 1) / kN; }
};

struct Args {
  int64_t t = 0, heads = 0, hkv = 0, g = 0, d = 0, dp = 0;  // dp: d padded (AMX: to whole tiles of 32)
  int64_t bs = 0, s_head = 0, s_block = 0, s_row = 0;
  const std::vector<Piece>* pieces = nullptr;
  const int64_t* blocks = nullptr;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* kp = nullptr;
  const void* vp = nullptr;
  void* out = nullptr;
  float scale = 1.0f, k_mul = 1.0f, v_mul = 1.0f;  // k_mul, v_mul: the pages' values are raw * these
  const float* slopes = nullptr;
};

template <typename In> constexpr bool kVnni = std::is_same_v<In, c10::BFloat16>;

// A packed tile's elements: K then V, each kN x dp of In.
template <typename In>
inline int64_t tile_elems(const Args& a) { return 2 * kN * a.dp; }

// Converts n floats into In at dst.
template <typename In>
inline void from_floats(const float* src, In* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<In, float>) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  } else {
    for (; i + 2 * kV <= n; i += 2 * kV) {
      const auto w = at::vec::convert_from_float<In>(Vec::loadu(src + i), Vec::loadu(src + i + kV));
      w.store(dst + i);
    }
    for (; i < n; ++i) dst[i] = static_cast<In>(src[i]);
  }
}

// One key row (d elements of Src) as In values, times mul, into row[0, dp) (zero past d).
template <typename Src, typename In>
inline void key_row(const Src* src, int64_t d, int64_t dp, float mul, float* tmp, In* row) {
  if constexpr (std::is_same_v<Src, In>) {
    if (mul == 1.0f) {
      std::memcpy(row, src, d * sizeof(In));
      for (int64_t i = d; i < dp; ++i) row[i] = In(0.0f);
      return;
    }
  }
  const Vec vm(mul);
  const int64_t chunks = (d + kV - 1) / kV;
  for (int64_t c = 0; c < chunks; ++c) {
    const Vec x = load_at<Src>(src, c, d) * vm;
    if ((c + 1) * kV <= dp) {
      x.store(tmp + c * kV);
    } else {
      x.store(tmp + c * kV, dp - c * kV);
    }
  }
  for (int64_t i = d; i < dp; ++i) tmp[i] = 0.0f;
  from_floats<In>(tmp, row, dp);
}

// Packs keys [first, first + kN) of piece p, KV head h (the piece's keys from key_start) into dst: K then V.
// bfloat16 (AMX): K^T and V in VNNI layout by blocks of 16 columns, each AMX tile of B 1 KiB in one piece: K^T
// as [kN / 16][dp / 2][16][2], V as [dp / 16][kN / 2][16][2]; float: K as [kN][dp], V as [kN][dp].
template <typename Page, typename Src, typename In>
void pack_tile(const Args& a, const Piece& pc, int64_t h, int64_t first, In* dst, float* tmp, In* rk, In* rv) {
  const int64_t d = a.d, dp = a.dp;
  In* kd = dst;
  In* vd = dst + kN * dp;
  const Page* kp = static_cast<const Page*>(a.kp);
  const Page* vp = static_cast<const Page*>(a.vp);
  const Src* ks = static_cast<const Src*>(a.k);
  const Src* vs = static_cast<const Src*>(a.v);
  const int64_t end = pc.position + pc.nq;
  const int64_t base_block = pc.key_start / a.bs;
  for (int64_t n = 0; n < kN; ++n) {
    const int64_t key = pc.key_start + first + n;
    if (key >= end) {
      std::fill(rk, rk + dp, In(0.0f));
      std::fill(rv, rv + dp, In(0.0f));
    } else if (key < pc.cache_end) {
      const int64_t block = a.blocks[pc.block_off + key / a.bs - base_block];
      const int64_t off = h * a.s_head + block * a.s_block + (key % a.bs) * a.s_row;
      key_row<Page, In>(kp + off, d, dp, a.k_mul, tmp, rk);
      key_row<Page, In>(vp + off, d, dp, a.v_mul, tmp, rv);
    } else {
      const int64_t off = ((pc.row + key - pc.position) * a.hkv + h) * d;
      key_row<Src, In>(ks + off, d, dp, 1.0f, tmp, rk);
      key_row<Src, In>(vs + off, d, dp, 1.0f, tmp, rv);
    }
    if constexpr (kVnni<In>) {
      // K^T: the row's element pairs (2i, 2i + 1) go to [n / 16][i][n % 16][0..1]
      const uint32_t* src = reinterpret_cast<const uint32_t*>(rk);
      uint32_t* kt = reinterpret_cast<uint32_t*>(kd) + (n / 16) * (dp / 2) * 16 + n % 16;
      for (int64_t i = 0; i < dp / 2; ++i) kt[i * 16] = src[i];
      // V: element x of rows n, n + 1 at [x / 16][n / 2][x % 16][n % 2]
      uint16_t* vt = reinterpret_cast<uint16_t*>(vd) + (n / 2) * 32 + (n % 2);
      const uint16_t* vr = reinterpret_cast<const uint16_t*>(rv);
      for (int64_t x = 0; x < dp; ++x) vt[(x / 16) * kN * 16 + (x % 16) * 2] = vr[x];
    } else {
      std::memcpy(kd + n * dp, rk, dp * sizeof(In));
      std::memcpy(vd + n * dp, rv, dp * sizeof(In));
    }
  }
}

// C = op(A) B + beta C, column-major (BLAS's sgemm, which torch's library exports: MKL's in torch's x86 wheels;
// cpublas::gemm's float overload, which calls it, is not exported).
inline void sgemm(char ta, char tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float beta, float* c, int64_t ldc) {
  int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
  float one = 1.0f;
  sgemm_(&ta, &tb, &mi, &ni, &ki, &one, a, &la, b, &lb, &beta, c, &lc);
}

#if defined(CHUNKATTN_AMX)
// Tiles (TileScope's configuration, one for both GEMMs): 0-3 C (float32 16 x 16), 4-5 A (bfloat16 16 x 32), 6-7 B
// (VNNI: 16 pairs of rows x 16 columns).
// C[m, n] = (C +) A[m, k] B[k, n]: A row-major bfloat16 (lda), B in VNNI layout by blocks of 16 columns,
// [n / 16][kb / 2][16][2] (kb >= k: the packed depth), C float32 (ldc); m, n, k multiples of 32. Blocks of
// 32 x 32 of C in four tiles, one of A's two row tiles and one of B's two column tiles loaded per product.
// One 32 x 32 block of C over the whole depth k.
__attribute__((always_inline)) inline void amx_block(int64_t k, const c10::BFloat16* a0, int64_t lda,
                                                     const c10::BFloat16* b0, int64_t kb, float* c0, int64_t ldc,
                                                     bool accumulate) {
  const int64_t sa = lda * 2, sc = ldc * 4;  // strides in bytes (B's: 64)
  const c10::BFloat16* a1 = a0 + 16 * lda;
  const c10::BFloat16* b1 = b0 + 16 * kb;
  float* c1 = c0 + 16 * ldc;
  if (accumulate) {
    _tile_loadd(0, c0, sc);
    _tile_loadd(1, c0 + 16, sc);
    _tile_loadd(2, c1, sc);
    _tile_loadd(3, c1 + 16, sc);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t x = 0; x < k; x += 32) {
    _tile_loadd(4, a0 + x, sa);  // each load as late as its first product allows
    _tile_loadd(6, b0 + x * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1 + x * 16, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + x, sa);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c0, sc);
  _tile_stored(1, c0 + 16, sc);
  _tile_stored(2, c1, sc);
  _tile_stored(3, c1 + 16, sc);
}

// C[m, n] = (C +) A[m, k] B[k, n]: A row-major bfloat16 (lda), B in VNNI layout by blocks of 16 columns,
// [n / 16][kb / 2][16][2] (kb >= k: the packed depth), C float32 (ldc); m, n, k multiples of 32. Blocks of
// 32 x 32 of C in four tiles.
inline void amx_gemm(int64_t m, int64_t n, int64_t k, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b,
                     int64_t kb, float* c, int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < m; i += 32)  // (columns outer measured the same here)
    for (int64_t j = 0; j < n; j += 32)
      amx_block(k, a + i * lda, lda, b + j * kb, kb, c + i * ldc + j, ldc, accumulate);
}
#endif

// S[rows, n] = Q[rows, dp] K^T for the tile's first n keys (ld kN); AMX: rows and dp multiples of 32.
template <typename In>
inline void scores_gemm(int64_t rows, int64_t n, int64_t dp, const In* q, const In* k, float* s) {
  if constexpr (kVnni<In>) {
#if defined(CHUNKATTN_AMX)
    amx_gemm(rows, n, dp, q, dp, k, dp, s, kLdS, false);
#else
    TORCH_CHECK(false, "chunkattn native prefill: no AMX in this build");
#endif
  } else {
    sgemm('T', 'N', n, rows, dp, k, dp, q, dp, 0.0f, s, kLdS);
  }
}

// O[rows, dp] += P[rows, n] V[n, dp] (P ld kN; n a multiple of 32).
template <typename In>
inline void values_gemm(int64_t rows, int64_t n, int64_t dp, const In* p, const In* v, float* o) {
  if constexpr (kVnni<In>) {
#if defined(CHUNKATTN_AMX)
    amx_gemm(rows, dp, n, p, kLdP, v, kN, o, dp + kPadO, true);
#else
    TORCH_CHECK(false, "chunkattn native prefill: no AMX in this build");
#endif
  } else {
    sgemm('N', 'N', dp, rows, n, v, dp, p, kLdP, 1.0f, o, dp + kPadO);
  }
}

// The largest of x[0, n) (n a multiple of kRound).
inline float row_max(const float* x, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  for (int64_t c = 32; c < n; c += 32) {
    a = _mm512_max_ps(a, _mm512_loadu_ps(x + c));
    b = _mm512_max_ps(b, _mm512_loadu_ps(x + c + 16));
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
#else
  Vec a(kNegInf);
  for (int64_t c = 0; c < n; c += kV) a = at::vec::maximum(a, Vec::loadu(x + c));
  return hmax(a);
#endif
}

#if defined(CHUNKATTN_AMX)
// 2^t for t <= 0 (-inf: 0), relative error under 1e-4 (a cubic on the fraction; the probabilities are rounded
// to bfloat16, 4e-3, after): for the bfloat16 engine only.
__attribute__((always_inline)) inline __m512 exp2_bf16(__m512 t) {
  // 2^-200 is 0 in float32; -inf would make the fraction NaN. A NaN score stays NaN (max_ps returns its second
  // operand when either is NaN), so its row's output is NaN, as in float32 and in SDPA.
  t = _mm512_max_ps(_mm512_set1_ps(-200.0f), t);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(0.07705805f), _mm512_set1_ps(0.22764558f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69512289f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// p[c] = exp(s[c] * mul - mx) for c < n (n a multiple of kRound), as In into p; returns their sum (float32,
// before rounding). Where In is float, p may be s itself. The exponent is clamped to 0 (mx is the scaled
// maximum): a fused multiply-add's unrounded product can pass the rounded one mx was taken from by half an ulp,
// thousands for scores near the value bounds (2^100), and exp of that is inf. A NaN stays NaN (min_ps returns
// its second operand then).
template <typename In>
inline float exp_row(const float* s, In* p, int64_t n, float mul, float mx) {
#if defined(CHUNKATTN_AMX)
  if constexpr (std::is_same_v<In, c10::BFloat16>) {
    constexpr float kLog2e = 1.4426950408889634f;
    const __m512 vm = _mm512_set1_ps(mul * kLog2e), vmx = _mm512_set1_ps(-mx * kLog2e);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += 32) {
      const __m512 zero = _mm512_setzero_ps();
      const __m512 e0 = exp2_bf16(_mm512_min_ps(zero, _mm512_fmadd_ps(_mm512_loadu_ps(s + c), vm, vmx)));
      const __m512 e1 = exp2_bf16(_mm512_min_ps(zero, _mm512_fmadd_ps(_mm512_loadu_ps(s + c + 16), vm, vmx)));
      sum0 = _mm512_add_ps(sum0, e0);
      sum1 = _mm512_add_ps(sum1, e1);
      _mm512_storeu_si512(p + c, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
  }
#endif
  const Vec vm(mul), vmx(-mx), zero(0.0f);
  Vec sum0(0.0f), sum1(0.0f);
  for (int64_t c = 0; c < n; c += 2 * kV) {
    const Vec e0 = at::vec::minimum(at::vec::fmadd(Vec::loadu(s + c), vm, vmx), zero).exp_u20();
    const Vec e1 = at::vec::minimum(at::vec::fmadd(Vec::loadu(s + c + kV), vm, vmx), zero).exp_u20();
    sum0 = sum0 + e0;
    sum1 = sum1 + e1;
    if constexpr (std::is_same_v<In, float>) {
      e0.store(p + c);
      e1.store(p + c + kV);
    } else {
      at::vec::convert_from_float<In>(e0, e1).store(p + c);
    }
  }
  return hsum(sum0 + sum1);
}

struct Task {
  int64_t piece, h, q0, qn, work;
};

// Phase 2 for the tasks, threads taking them from a shared counter.
template <typename Qt, typename In, typename Out>
void attend_tasks(const Args& a, const std::vector<Task>& tasks, const std::vector<int64_t>& tile_base,
                  const In* packed, int64_t qm) {
  const int64_t g = a.g, d = a.d, dp = a.dp;
  const int64_t max_rows = (qm * g + 31) / 32 * 32;  // (AMX: tiles of 16 rows, in pairs)
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
#if defined(CHUNKATTN_AMX)
    std::optional<TileScope> scope;  // the tiles configured for this thread's tasks (one configuration: 16 x 64 B)
    if constexpr (kVnni<In>) scope.emplace();
#endif
    const int64_t ldo = dp + kPadO;
    std::vector<In> qb(max_rows * dp, In(0.0f)), pb(max_rows * kLdP, In(0.0f));
    std::vector<float> s(max_rows * kLdS), o(max_rows * ldo), m(max_rows), l(max_rows), qf(dp);
    const Qt* qp = static_cast<const Qt*>(a.q);
    Out* op = static_cast<Out*>(a.out);
    for (int64_t w = next++; w < static_cast<int64_t>(tasks.size()); w = next++) {
      const Task& tk = tasks[w];
      const Piece& pc = (*a.pieces)[tk.piece];
      const int64_t rows = tk.qn * g;
      const int64_t rows_p = kVnni<In> ? (rows + 31) / 32 * 32 : rows;  // the GEMMs' rows (padding: zeros)
      for (int64_t i = 0; i < tk.qn; ++i)
        for (int64_t j = 0; j < g; ++j) {
          const Qt* src = qp + ((pc.row + tk.q0 + i) * a.heads + tk.h * g + j) * d;
          In* dst = qb.data() + (i * g + j) * dp;
          if constexpr (std::is_same_v<Qt, In>) {
            std::memcpy(dst, src, d * sizeof(In));
            for (int64_t x = d; x < dp; ++x) dst[x] = In(0.0f);
          } else {
            for (int64_t x = 0; x < d; ++x) qf[x] = static_cast<float>(src[x]);
            for (int64_t x = d; x < dp; ++x) qf[x] = 0.0f;
            from_floats<In>(qf.data(), dst, dp);
          }
        }
      std::fill(o.begin(), o.begin() + rows_p * ldo, 0.0f);
      std::fill(pb.begin() + rows * kLdP, pb.begin() + rows_p * kLdP, In(0.0f));
      std::fill(qb.begin() + rows * dp, qb.begin() + rows_p * dp, In(0.0f));
      std::fill(m.begin(), m.begin() + rows, kNegInf);
      std::fill(l.begin(), l.begin() + rows, 0.0f);
      const int64_t first_pos = pc.position + tk.q0, last_pos = first_pos + tk.qn - 1;
      const int64_t tiles = (last_pos + 1 - pc.key_start + kN - 1) / kN;
      const In* base = packed + (tile_base[tk.piece] + tk.h * pc.tiles()) * tile_elems<In>(a);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t ts = pc.key_start + t * kN;  // the tile's first key
        const int64_t seen = std::min(kN, last_pos + 1 - ts);  // keys of the tile the last query sees
        const int64_t n = std::min(kN, (seen + kRound - 1) / kRound * kRound);
        const bool masked = ts + n - 1 > first_pos;  // some query does not see some of the n keys
        const In* kt = base + t * tile_elems<In>(a);
        const In* vt = kt + kN * dp;
        scores_gemm<In>(rows_p, n, dp, qb.data(), kt, s.data());
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t pos = first_pos + r / g;
          const int64_t count = masked ? std::max<int64_t>(0, std::min(n, pos + 1 - ts)) : n;
          float* sr = s.data() + r * kLdS;
          In* pr = pb.data() + r * kLdP;
          if (count == 0) {
            std::fill(pr, pr + n, In(0.0f));
            continue;
          }
          // Scores s * mul (the scale folded in, when positive: the raw maximum is the scaled one's), ALiBi added
          // in place first where there is one; the keys past `count` are -inf (weight 0).
          float mul = a.scale;
          if (a.slopes || mul <= 0.0f) {
            const float slope = a.slopes ? a.slopes[tk.h * g + r % g] : 0.0f;
            for (int64_t c = 0; c < count; ++c) sr[c] = sr[c] * a.scale + slope * static_cast<float>(ts + c - pos);
            mul = 1.0f;
          }
          for (int64_t c = count; c < n; ++c) sr[c] = kNegInf;
          const float mx = std::max(m[r], row_max(sr, n) * mul);
          const float alpha = std::exp(m[r] - mx);  // m = -inf at first: alpha 0, o and l are 0
          l[r] = l[r] * alpha + exp_row<In>(sr, pr, n, mul, mx);
          m[r] = mx;
          if (alpha != 1.0f && t > 0) {
            const Vec va(alpha);
            float* orow = o.data() + r * ldo;
            int64_t y = 0;
            for (; y + kV <= dp; y += kV) (Vec::loadu(orow + y) * va).store(orow + y);
            for (; y < dp; ++y) orow[y] *= alpha;
          }
        }
        values_gemm<In>(rows_p, n, dp, pb.data(), vt, o.data());
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r / g, j = r % g;
        const float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
        Out* dst = op + ((pc.row + tk.q0 + i) * a.heads + tk.h * g + j) * d;
        const float* src = o.data() + r * ldo;
        for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<Out>(src[x] * inv);
      }
    }
  });
}

template <typename Page, typename Src, typename In>
void run(const Args& a) {
  const std::vector<Piece>& pieces = *a.pieces;
  const int64_t tile_bytes = tile_elems<In>(a) * static_cast<int64_t>(sizeof(In));
  const int64_t qm = std::max<int64_t>(1, kRows / a.g);
  size_t first = 0;
  while (first < pieces.size()) {  // a group of pieces whose packed K/V fit kPackBytes
    size_t last = first;
    int64_t tiles = 0;
    std::vector<int64_t> tile_base(pieces.size(), 0);
    while (last < pieces.size()) {
      const int64_t more = pieces[last].tiles() * a.hkv;
      if (last > first && (tiles + more) * tile_bytes > kPackBytes) break;
      tile_base[last] = tiles;
      tiles += more;
      ++last;
    }
    std::unique_ptr<In[]> packed(new In[tiles * tile_elems<In>(a)]);  // every element is written
    // Phase 1: (piece, head, tile) over the threads.
    std::vector<std::tuple<int64_t, int64_t, int64_t>> jobs;
    jobs.reserve(tiles);
    for (size_t p = first; p < last; ++p)
      for (int64_t h = 0; h < a.hkv; ++h)
        for (int64_t t = 0; t < pieces[p].tiles(); ++t) jobs.emplace_back(p, h, t);
    at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(a.dp + kV);
      std::vector<In> rk(a.dp + 2), rv(a.dp + 2);
      for (int64_t j = begin; j < end; ++j) {
        const auto [p, h, t] = jobs[j];
        const Piece& pc = pieces[p];
        In* dst = packed.get() + (tile_base[p] + h * pc.tiles() + t) * tile_elems<In>(a);
        pack_tile<Page, Src, In>(a, pc, h, t * kN, dst, tmp.data(), rk.data(), rv.data());
      }
    });
    // Phase 2: (piece, head, query tile), the largest first.
    std::vector<Task> tasks;
    for (size_t p = first; p < last; ++p)
      for (int64_t h = 0; h < a.hkv; ++h)
        for (int64_t q0 = 0; q0 < pieces[p].nq; q0 += qm) {
          const int64_t qn = std::min(qm, pieces[p].nq - q0);
          tasks.push_back({static_cast<int64_t>(p), h, q0, qn, pieces[p].position + q0 + qn - pieces[p].key_start});
        }
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.work > y.work; });
    attend_tasks<Src, In, Src>(a, tasks, tile_base, packed.get(), qm);
    first = last;
  }
}

template <typename Src, typename In>
void run_pages(const Args& a, at::ScalarType page_type) {
  switch (page_type) {
    case at::kFloat: return run<float, Src, In>(a);
    case at::kBFloat16: return run<c10::BFloat16, Src, In>(a);
    case at::kHalf: return run<c10::Half, Src, In>(a);
    case at::kFloat8_e4m3fn: return run<E4M3, Src, In>(a);
    case at::kFloat8_e5m2: return run<E5M2, Src, In>(a);
    default: TORCH_CHECK(false, "chunkattn native prefill: pages of dtype ", page_type, " are not served");
  }
}

// Whether bfloat16 compute runs on the AMX tiles (this build has them, and Linux lets this process use them);
// else everything computes in float32.
bool amx_bf16() {
#if defined(CHUNKATTN_AMX)
  return tiles_granted();
#else
  return false;
#endif
}

}  // namespace

// Every prefill piece of a call. q [T, H, D], k, v [T, Hkv, D] (the compute dtype: float32, bfloat16 or
// float16; contiguous); pages [Hkv, num_blocks, bs, D] (float32, bfloat16, float16, or float8 read as stored *
// k_scale / v_scale); pieces [P, 6] int64: per piece (row, num_queries, position, key_start, cache_end,
// first block in `blocks`); blocks [B] int64: piece p's keys [key_start, cache_end) are in its blocks
// blocks[first ...], one per bs positions from key_start's block; keys [cache_end, position + num_queries) are
// rows row + (key - position) of k and v. Query position + i of a piece sees its keys up to position + i.
// out [T, H, D] (q's dtype): the pieces' rows are written. Everything is checked before anything is read.
void prefill(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_pages, at::Tensor v_pages, at::Tensor pieces,
             at::Tensor blocks, at::Tensor out, double scale, double k_scale, double v_scale,
             c10::optional<at::Tensor> alibi) {
  const auto type = q.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
              "q must be float32, bfloat16 or float16");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [T, H, D]");
  const int64_t t = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(k_pages.dim() == 4 && k_pages.size(3) == d && k_pages.stride(3) == 1 &&
                  k_pages.strides() == v_pages.strides() && k_pages.sizes() == v_pages.sizes() &&
                  k_pages.scalar_type() == v_pages.scalar_type(), "pages must be [Hkv, blocks, bs, D], K and V alike");
  const int64_t hkv = k_pages.size(0), nblocks = k_pages.size(1), bs = k_pages.size(2);
  TORCH_CHECK(heads > 0 && d > 0 && bs > 0, "q must have heads and a head size, the pages a block size");
  TORCH_CHECK(hkv > 0 && heads % hkv == 0, "query heads must be a multiple of KV heads");
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->is_contiguous() && x->dim() == 3 && x->size(0) == t && x->size(1) == hkv && x->size(2) == d &&
                    x->scalar_type() == type, "k and v must be contiguous [T, Hkv, D] of q's dtype");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == type,
              "out must be contiguous, q's shape and dtype");
  TORCH_CHECK(pieces.scalar_type() == at::kLong && pieces.is_contiguous() && pieces.dim() == 2 && pieces.size(1) == 6,
              "pieces must be contiguous int64 [P, 6]");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.is_contiguous() && blocks.dim() == 1,
              "blocks must be contiguous int64 [B]");
  TORCH_CHECK(!alibi.has_value() || (alibi->scalar_type() == at::kFloat && alibi->is_contiguous() &&
                                     alibi->numel() == heads), "alibi slopes must be float32 [H]");
  const int64_t* pm = pieces.data_ptr<int64_t>();
  // The block ids, copied: they are checked here and read after the GIL is released, and must not change between.
  const int64_t* given = blocks.data_ptr<int64_t>();
  const int64_t nb = blocks.numel();
  const std::vector<int64_t> block_ids(given, given + nb);
  const int64_t* bp = block_ids.data();
  // Positions stay far from int64's end, so that no sum of a position and a count below can overflow.
  constexpr int64_t kMaxPosition = int64_t{1} << 62;
  std::vector<Piece> list;
  for (int64_t p = 0; p < pieces.size(0); ++p) {
    const int64_t* r = pm + p * 6;
    Piece pc{r[0], r[1], r[2], r[3], r[4], r[5]};
    TORCH_CHECK(pc.row >= 0 && pc.row <= t && pc.nq >= 1 && pc.nq <= t - pc.row, "piece ", p,
                ": its rows are not in q");
    TORCH_CHECK(0 <= pc.position && pc.position <= kMaxPosition, "piece ", p, ": position ", pc.position,
                " is not in [0, 2^62]");
    TORCH_CHECK(0 <= pc.key_start && pc.key_start <= pc.position && pc.key_start <= pc.cache_end &&
                    pc.position <= pc.cache_end && pc.cache_end <= pc.position + pc.nq,
                "piece ", p, ": keys [", pc.key_start, ", ", pc.cache_end, ") cached before queries from ", pc.position,
                " are not a piece's");
    if (pc.cache_end > pc.key_start) {
      const int64_t count = (pc.cache_end - 1) / bs - pc.key_start / bs + 1;
      TORCH_CHECK(pc.block_off >= 0 && pc.block_off <= nb && count <= nb - pc.block_off, "piece ", p, ": its ",
                  count, " blocks are not in blocks");
      for (int64_t b = 0; b < count; ++b)
        TORCH_CHECK(0 <= bp[pc.block_off + b] && bp[pc.block_off + b] < nblocks, "piece ", p, ": block ",
                    bp[pc.block_off + b], " is not in the pages (", nblocks, " blocks)");
    }
    list.push_back(pc);
  }
  if (list.empty()) return;
  pybind11::gil_scoped_release nogil;
  Args a;
  a.t = t;
  a.heads = heads;
  a.hkv = hkv;
  a.g = heads / hkv;
  a.d = d;
  a.bs = bs;
  a.s_head = k_pages.stride(0);
  a.s_block = k_pages.stride(1);
  a.s_row = k_pages.stride(2);
  a.pieces = &list;
  a.blocks = bp;
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.kp = k_pages.data_ptr();
  a.vp = v_pages.data_ptr();
  a.out = out.data_ptr();
  a.scale = static_cast<float>(scale);
  a.slopes = alibi.has_value() ? alibi->data_ptr<float>() : nullptr;
  const auto page_type = k_pages.scalar_type();
  const bool fp8 = page_type == at::kFloat8_e4m3fn || page_type == at::kFloat8_e5m2;
  const float raw = page_type == at::kFloat8_e4m3fn ? kRawScale<E4M3> : 1.0f;
  a.k_mul = fp8 ? static_cast<float>(k_scale) * raw : 1.0f;
  a.v_mul = fp8 ? static_cast<float>(v_scale) * raw : 1.0f;
  const bool vnni = type == at::kBFloat16 && amx_bf16();
  a.dp = vnni ? (d + 31) / 32 * 32 : d;  // AMX: whole tiles of 32 bfloat16
  switch (type) {
    case at::kFloat: return run_pages<float, float>(a, page_type);
    case at::kBFloat16:
      if (vnni) return run_pages<c10::BFloat16, c10::BFloat16>(a, page_type);
      return run_pages<c10::BFloat16, float>(a, page_type);
    default: return run_pages<c10::Half, float>(a, page_type);
  }
}

void bind_prefill(pybind11::module_& m) {
  m.def("prefill", &prefill,
        "every prefill piece of a call over the paged cache and the call's own K/V (see prefill.cpp)");
}

}  // namespace chunkattn

// chunkattn's native CPU decode kernel: every decode of a step in one call, reading the paged cache through
// the block table (no gather), all query heads of one KV head together (each K/V row read once), float32
// accumulation with an online softmax, float16/bfloat16/float8 pages converted in registers, ALiBi, and a
// split over keys (merged exactly by log-sum-exp) when there are fewer sequence x KV head tasks than threads
// can share. Built per ISA (the file is compiled with the flags of each: at::vec::Vectorized and the
// intrinsics below are as wide as they allow) and chosen at run time (native/build.py).
//
// A decode s of the step: its one query q[s] [H, D] sees the keys [key_start[s], key_end[s]) (key_end = its
// position + 1: its own key is in the cache already). The key at absolute position p lives in physical block
// tables[s][p / bs - key_start[s] / bs], row p % bs, of the pages [Hkv, num_blocks, bs, D].

#include "pages.h"
#include "amx.h"
#include "store.h"

#include <pybind11/numpy.h>
#include <atomic>
#include <optional>
#include <type_traits>
#include <vector>


namespace {

using namespace chunkattn;

constexpr int64_t kHeadsAtOnce = 8;  // query heads whose accumulators stay in registers together
constexpr int64_t kTile = 32;        // keys scored, softmaxed and accumulated together (a multiple of kV)
static_assert(kTile % kV == 0, "a tile's scores are read in whole vectors");

// Calls f(std::integral_constant<int, n>) for n in [1, kHeadsAtOnce]: the loops over a group's heads then
// have a bound known at compile time and keep their accumulators in registers.
template <typename F>
inline void with_heads(int64_t n, F&& f) {
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// scores[j * kTile + r] = q_j . k_r for G heads (q [G, dv], zero past d) and K rows krows[0, rows): two rows at
// a time, so 2G independent sums are in flight. Meanwhile the rows pk[r], pv[r] (r < pf_rows: the next tile's)
// are prefetched, two per row pair, into L2 (prefetcht1): into L1 the prefetches hold the line-fill buffers
// that this tile's own loads wait for (fp32 decode 63 -> 43 ms, bf16 34 -> 23 here with L2).
template <typename Page, int G>
inline void score_rows(const Page* const* krows, int64_t rows, const float* q, int64_t dv, int64_t d, float* scores,
                       const Page* const* pk, const Page* const* pv, int64_t pf_rows) {
  const int64_t chunks = dv / kV;
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(Page));
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    for (int64_t x = r; x < std::min(r + 2, pf_rows); ++x)
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(pk[x]) + b, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(pv[x]) + b, 0, 2);
      }
    Vec a[G], b[G];
    for (int j = 0; j < G; ++j) a[j] = b[j] = Vec(0.0f);
    for (int64_t i = 0; i < chunks; ++i) {
      const Vec k0 = load_at<Page>(krows[r], i, d), k1 = load_at<Page>(krows[r + 1], i, d);
      for (int j = 0; j < G; ++j) {
        const Vec qj = Vec::loadu(q + j * dv + i * kV);
        a[j] = at::vec::fmadd(qj, k0, a[j]);
        b[j] = at::vec::fmadd(qj, k1, b[j]);
      }
    }
    for (int j = 0; j < G; ++j) {
      scores[j * kTile + r] = hsum(a[j]);
      scores[j * kTile + r + 1] = hsum(b[j]);
    }
  }
  for (; r < rows; ++r) {
    Vec a[G];
    for (int j = 0; j < G; ++j) a[j] = Vec(0.0f);
    for (int64_t i = 0; i < chunks; ++i) {
      const Vec k0 = load_at<Page>(krows[r], i, d);
      for (int j = 0; j < G; ++j) a[j] = at::vec::fmadd(Vec::loadu(q + j * dv + i * kV), k0, a[j]);
    }
    for (int j = 0; j < G; ++j) scores[j * kTile + r] = hsum(a[j]);
  }
}

// acc_j += sum_r p[j * kTile + r] v_r for G heads (acc [G, dv]) over V rows vrows[0, rows): per kV-wide slice,
// each V row's slice read once for all G heads, even and odd rows in separate sums.
template <typename Page, int G>
inline void accumulate_rows(const Page* const* vrows, int64_t rows, const float* p, int64_t dv, int64_t d, float* acc) {
  const int64_t chunks = dv / kV;
  for (int64_t i = 0; i < chunks; ++i) {
    Vec a[G], b[G];
    for (int j = 0; j < G; ++j) {
      a[j] = Vec::loadu(acc + j * dv + i * kV);
      b[j] = Vec(0.0f);
    }
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
      const Vec v0 = load_at<Page>(vrows[r], i, d), v1 = load_at<Page>(vrows[r + 1], i, d);
      for (int j = 0; j < G; ++j) {
        a[j] = at::vec::fmadd(Vec(p[j * kTile + r]), v0, a[j]);
        b[j] = at::vec::fmadd(Vec(p[j * kTile + r + 1]), v1, b[j]);
      }
    }
    if (r < rows) {
      const Vec v0 = load_at<Page>(vrows[r], i, d);
      for (int j = 0; j < G; ++j) a[j] = at::vec::fmadd(Vec(p[j * kTile + r]), v0, a[j]);
    }
    for (int j = 0; j < G; ++j) (a[j] + b[j]).store(acc + j * dv + i * kV);
  }
}

struct Shape {
  int64_t n, heads, kv_heads, g, d, dv;  // dv: d rounded up to kV (the padded width of q and accumulators)
  int64_t bs, width, s_head, s_block, s_row;
};

#if defined(CHUNKATTN_AMX)
// -- bfloat16 operands for the AMX tiles (the AMX build: AVX512-BF16) -----------------------------------------

inline __m512i pack_bf16(__m512 lo, __m512 hi) {  // 32 bfloat16: lo's 16 then hi's (round to nearest even)
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

// n <= 32 elements of a page row as 32 bfloat16 (times 1 / kRawScale; zero past n).
template <typename Page> inline __m512i load_bf16(const Page* p, int64_t n);
template <> inline __m512i load_bf16<c10::BFloat16>(const c10::BFloat16* p, int64_t n) {
  return _mm512_maskz_loadu_epi16(n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1, p);
}
inline __m512i codes16(const void* p, int64_t n) {  // n <= 32 bytes, zero-extended to 16 bits each
  return _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1, p));
}
inline __m512i half_to_bf16(__m512i h) {  // 32 float16 -> 32 bfloat16 (exact for float8 values)
  return pack_bf16(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
}
template <> inline __m512i load_bf16<E5M2>(const E5M2* p, int64_t n) {
  return half_to_bf16(_mm512_slli_epi16(codes16(p, n), 8));
}
template <> inline __m512i load_bf16<E4M3>(const E4M3* p, int64_t n) {
  // sign << 15 | magnitude << 7 (the float16 of value / 256): the code in the top byte, shifted right by one
  // arithmetically (the sign lands in bits 15 and 14), bit 14 cleared; the NaN codes become a float16 NaN
  const __m512i c = codes16(p, n);
  __m512i h = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(c, 8), 1), _mm512_set1_epi16(static_cast<short>(0xbfff)));
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(c, _mm512_set1_epi16(0x7f)), _mm512_set1_epi16(0x7f));
  return half_to_bf16(_mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7e00)));
}


#endif  // CHUNKATTN_AMX

// The K and V rows of keys [t0, t0 + rows) of one KV head (head_off into the pages): rows of the pages through
// the table, stepping through each block's rows (one division per tile), or, for the key `pos` where own_k is
// set (a decode whose key is not in the pages), its own row; that key is the task's last, and the table is
// not read for its block.
template <typename Page>
inline void tile_rows(const Shape& sh, const Page* kp, const Page* vp, const int32_t* table, int64_t base_block,
                      int64_t head_off, int64_t t0, int64_t rows, int64_t pos, const Page* own_k, const Page* own_v,
                      const Page** krows, const Page** vrows) {
  int64_t block = t0 / sh.bs, r = t0 % sh.bs;
  auto start = [&] { return head_off + static_cast<int64_t>(table[block - base_block]) * sh.s_block; };
  int64_t off = own_k != nullptr && t0 == pos ? 0 : start();
  for (int64_t i = 0; i < rows; ++i) {
    if (own_k != nullptr && t0 + i == pos) {
      krows[i] = own_k;
      vrows[i] = own_v;
      break;
    }
    krows[i] = kp + off + r * sh.s_row;
    vrows[i] = vp + off + r * sh.s_row;
    if (++r == sh.bs && i + 1 < rows && !(own_k != nullptr && t0 + i + 1 == pos)) {
      r = 0;
      ++block;
      off = start();
    }
  }
}

// A task's keys [first, last) of KV head h, tile by tile (kTile keys): body(t0, rows, krows, vrows, next_k,
// next_v, pf_rows) with this tile's K and V rows and the next tile's, whose first pf_rows are in the pages (to be
// prefetched while this tile is computed: one core's demand misses alone leave the memory idle much of the time,
// and a block of another sequence's, in a scattered pool, is a new page the hardware prefetcher cannot guess).
// krows, vrows [2 * kTile]: the two tiles' rows, swapped per tile.
template <typename Page, typename Body>
inline void walk_tiles(const Shape& sh, const Page* kp, const Page* vp, const int32_t* table, int64_t base_block,
                       int64_t h, int64_t first, int64_t last, int64_t pos, const Page* own_k, const Page* own_v,
                       const Page** krows, const Page** vrows, Body&& body) {
  const int64_t head_off = h * sh.s_head;
  own_k = own_k != nullptr ? own_k + h * sh.d : nullptr;
  own_v = own_v != nullptr ? own_v + h * sh.d : nullptr;
  const Page **cur_k = krows, **cur_v = vrows, **next_k = krows + kTile, **next_v = vrows + kTile;
  if (first < last)
    tile_rows(sh, kp, vp, table, base_block, head_off, first, std::min(kTile, last - first), pos, own_k, own_v,
              cur_k, cur_v);
  for (int64_t t0 = first; t0 < last; t0 += kTile, std::swap(cur_k, next_k), std::swap(cur_v, next_v)) {
    const int64_t rows = std::min(kTile, last - t0);
    const int64_t next_rows = std::max<int64_t>(0, std::min(kTile, last - t0 - kTile));
    if (next_rows > 0)
      tile_rows(sh, kp, vp, table, base_block, head_off, t0 + kTile, next_rows, pos, own_k, own_v, next_k, next_v);
    const int64_t pf_rows = next_rows - (own_k != nullptr && t0 + kTile + next_rows - 1 == pos ? 1 : 0);
    body(t0, rows, static_cast<const Page* const*>(cur_k), static_cast<const Page* const*>(cur_v),
         static_cast<const Page* const*>(next_k), static_cast<const Page* const*>(next_v), pf_rows);
  }
}

// One task: query heads [h * g, h * g + g) of decode s over its keys [first, last). Leaves the unnormalized
// accumulators in acc [g, dv] and the running max and sum in m, l [g].
template <typename Page>
void attend_range(const Shape& sh, const Page* kp, const Page* vp, const int32_t* table, int64_t base_block,
                  const float* qs, int64_t h, int64_t first, int64_t last, int64_t pos, const float* slopes,
                  float* acc, float* m, float* l, float* scores, const Page** krows, const Page** vrows,
                  const Page* own_k, const Page* own_v) {
  const int64_t g = sh.g, d = sh.d, dv = sh.dv;
  std::fill(acc, acc + g * dv, 0.0f);
  std::fill(m, m + g, kNegInf);
  std::fill(l, l + g, 0.0f);
  // the next tile's rows prefetched while this tile's K rows are scored (two rows' lines per row pair)
  walk_tiles(sh, kp, vp, table, base_block, h, first, last, pos, own_k, own_v, krows, vrows,
             [&](int64_t t0, int64_t rows, const Page* const* krows_t, const Page* const* vrows_t,
                 const Page* const* next_k, const Page* const* next_v, int64_t pf_rows) {
    // scores[j * kTile + r] = q_j . k_r (q pre-scaled), all heads of the group per K row read
    for (int64_t j0 = 0; j0 < g; j0 += kHeadsAtOnce)
      with_heads(std::min(kHeadsAtOnce, g - j0), [&](auto gn) {
        score_rows<Page, decltype(gn)::value>(krows_t, rows, qs + j0 * dv, dv, d, scores + j0 * kTile, next_k, next_v,
                                                j0 == 0 ? pf_rows : 0);
      });
    const int64_t padded = (rows + kV - 1) / kV * kV;
    for (int64_t j = 0; j < g; ++j) {  // online softmax over the tile
      float* sj = scores + j * kTile;
      if (slopes)
        for (int64_t r = 0; r < rows; ++r) sj[r] += slopes[h * g + j] * static_cast<float>(t0 + r - pos);
      for (int64_t r = rows; r < padded; ++r) sj[r] = kNegInf;
      Vec vmax(kNegInf);
      for (int64_t r = 0; r < padded; r += kV) vmax = at::vec::maximum(vmax, Vec::loadu(sj + r));
      const float mx = std::max(m[j], hmax(vmax));
      if (mx == kNegInf) {  // nothing seen yet (only -inf scores): no weight
        std::fill(sj, sj + padded, 0.0f);
        continue;
      }
      const float alpha = std::exp(m[j] - mx);
      const Vec vmx(mx);
      Vec sum(0.0f);
      for (int64_t r = 0; r < padded; r += kV) {
        const Vec p = (Vec::loadu(sj + r) - vmx).exp_u20();
        p.store(sj + r);
        sum = sum + p;
      }
      l[j] = l[j] * alpha + hsum(sum);
      m[j] = mx;
      if (alpha != 1.0f) {
        const Vec va(alpha);
        for (int64_t i = 0; i < dv; i += kV) (Vec::loadu(acc + j * dv + i) * va).store(acc + j * dv + i);
      }
    }
    // acc_j += sum_r p_jr v_r: per kV-wide slice of the head, each V row's slice read once for all heads
    for (int64_t j0 = 0; j0 < g; j0 += kHeadsAtOnce)
      with_heads(std::min(kHeadsAtOnce, g - j0), [&](auto gn) {
        accumulate_rows<Page, decltype(gn)::value>(vrows_t, rows, scores + j0 * kTile, dv, d, acc + j0 * dv);
      });
  });
}

#if defined(CHUNKATTN_AMX)
// -- AMX: bfloat16 tiles for bfloat16 and float8 caches --------------------------------------------------------
//
// One task's query heads (up to 16 at a time) against a 32-key tile, on the tiles' bfloat16 matrix multiply:
// - scores, transposed: S^T [16 keys, 16 heads] = K [16 keys, 32 d] x Q^T [32 d, 16 heads], summed over the
//   head's 32-wide slices of d. K is the A operand as the pages hold it (a block's rows, loaded with the row
//   stride: no copy where 16 keys lie in one block of a bfloat16 cache; else copied, or converted from float8,
//   into a scratch tile); Q^T, in the tiles' pairwise (VNNI) layout, is built once per task.
// - the online softmax per head, over each head's column of S^T (gathered), in float32; P in bfloat16.
// - O [16 heads, 16 d] += P [16 heads, 32 keys] x V [32 keys, 16 d] per 16-wide slice of d, V repacked
//   pairwise (two keys' elements interleaved) once per tile, O kept in float32 in memory between tiles.
// Only where the compute dtype is bfloat16 (q and the output): the query is exactly a bfloat16 operand and P's
// rounding to bfloat16 is below the output's. AMX flushes subnormal inputs and outputs to zero.
namespace amx {

bool ready = false;  // Linux gave this process the tiles' state (tiles_granted, at import); else AVX-512 serves
// When the tiles serve (use_tiles; tests and benchmarks compare the paths): never, from kMinHeads query heads per
// KV head (the default where ready), or always.
enum Mode : int { kNever = 0, kAuto = 1, kAlways = 2 };
std::atomic<int> mode{kNever};

constexpr int64_t kKeys = 16;  // keys per S^T tile (its rows)
constexpr int64_t kHeads = 16;  // query heads per pass (S^T's columns, P's rows)
constexpr int64_t kWide = 32;  // bfloat16 per 64-byte tile row
// The fewest query heads per KV head for which the tiles beat the vector units (benchmarks/decode_isa.py: 32
// decodes over 4,096 keys, 8 KV heads of 128, 4 to 16 query heads each, on a 2-core Xeon with AMX): a tile's
// 16 rows are the query heads, so with 4 of them three quarters of its work is padding, and the decode waits on
// memory anyway; a float8 page's conversion to bfloat16 (both K and V, once per element) pays from more heads.
template <typename Page> constexpr int64_t kMinHeads = 8;
template <> constexpr int64_t kMinHeads<E4M3> = 16;
template <> constexpr int64_t kMinHeads<E5M2> = 16;

// Tiles (TileScope's configuration): 0 S^T (C), 1 K (A), 2 Q^T (B), 3 O (C), 4 P (A), 5 V (B).
template <typename Page> constexpr bool kServes = false;
template <> constexpr bool kServes<c10::BFloat16> = true;
template <> constexpr bool kServes<E4M3> = true;
template <> constexpr bool kServes<E5M2> = true;

// The tiles' layouts, all in one 64-byte aligned allocation per thread.
class Buffers {
 public:
  Buffers(int64_t d, int64_t dv) : dp_((d + kWide - 1) / kWide * kWide), dv_(dv) {
    const size_t bytes = qt_bytes() + k_bytes() + st_bytes() + p_bytes() + v_bytes() + o_bytes();
    base_ = static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    TORCH_CHECK(base_ != nullptr, "chunkattn native decode: out of memory for the AMX scratch");
    std::memset(base_, 0, bytes);
  }
  ~Buffers() { std::free(base_); }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;

  int64_t dp() const { return dp_; }
  // Q^T [dp / 32][16 d-pairs][16 heads x 2] bfloat16: tile 2's operand for each 32-wide slice of d
  uint16_t* qt() { return reinterpret_cast<uint16_t*>(base_); }
  // K [16 keys][dp] bfloat16: tile 1's operand where it is not read from the pages
  uint16_t* k() { return reinterpret_cast<uint16_t*>(base_ + qt_bytes()); }
  // S^T [32 keys][16 heads] float32
  float* st() { return reinterpret_cast<float*>(base_ + qt_bytes() + k_bytes()); }
  // P [16 heads][32 keys] bfloat16 (rows past the pass's heads stay zero)
  uint16_t* p() { return reinterpret_cast<uint16_t*>(base_ + qt_bytes() + k_bytes() + st_bytes()); }
  // V [dv / 16][16 key pairs][16 d x 2] bfloat16
  uint16_t* v() { return reinterpret_cast<uint16_t*>(base_ + qt_bytes() + k_bytes() + st_bytes() + p_bytes()); }
  // O [16 heads][dv] float32: the pass's unnormalized accumulators
  float* o() { return reinterpret_cast<float*>(base_ + qt_bytes() + k_bytes() + st_bytes() + p_bytes() + v_bytes()); }

 private:
  size_t qt_bytes() const { return dp_ * kHeads * 2; }
  size_t k_bytes() const { return kKeys * dp_ * 2; }
  size_t st_bytes() const { return 2 * kKeys * kHeads * 4; }
  size_t p_bytes() const { return kHeads * kWide * 2; }
  size_t v_bytes() const { return dv_ * kWide * 2; }
  size_t o_bytes() const { return kHeads * dv_ * 4; }
  int64_t dp_, dv_;
  uint8_t* base_ = nullptr;
};

// Whether 16 row addresses are consecutive rows of the pages (one tile load reads them): every step checked, as 16
// keys over blocks smaller than 16 may start and end 15 rows apart with other blocks between.
template <typename Page>
inline bool consecutive(const Page* const* rows, int64_t s_row) {
  for (int64_t r = 1; r < kKeys; ++r)
    if (rows[r] != rows[0] + r * s_row) return false;
  return true;
}

// Query heads [j0, j0 + gn) (gn <= 16) of one task against its keys [first, last), as attend_range does on the
// vector units: leaves the unnormalized accumulators in acc [gn, dv] (row j at acc + j * dv) and the running max
// and sum in m, l [gn]. q: the task's g queries [g, d] float32 (bfloat16 values, unscaled); scores are scaled by
// q_mul in float32.
template <typename Page>
void attend_range(const Shape& sh, const Page* kp, const Page* vp, const int32_t* table, int64_t base_block,
                  const float* q, float q_mul, int64_t j0, int64_t gn, int64_t h, int64_t first, int64_t last,
                  int64_t pos, const float* slopes, float* acc, float* m, float* l, Buffers& bf, const Page** krows,
                  const Page** vrows, const Page* own_k, const Page* own_v) {
  const int64_t d = sh.d, dv = sh.dv, dp = bf.dp(), slices = dp / kWide, outs = dv / kV;
  uint16_t *qt = bf.qt(), *kt = bf.k(), *pt = bf.p(), *vt = bf.v();
  float *st = bf.st(), *o = bf.o();
  for (int64_t c = 0; c < slices; ++c)  // Q^T pairwise: element (d pair i, head n, e) = q[n][32c + 2i + e]
    for (int64_t i = 0; i < kWide / 2; ++i)
      for (int64_t n = 0; n < kHeads; ++n)
        for (int64_t e = 0; e < 2; ++e) {
          const int64_t at = c * kWide + 2 * i + e;
          const float x = n < gn && at < d ? q[(j0 + n) * d + at] : 0.0f;
          qt[(c * kWide / 2 + i) * kWide + 2 * n + e] = c10::BFloat16(x).x;
        }
  std::memset(pt, 0, kHeads * kWide * 2);
  std::fill(o, o + kHeads * dv, 0.0f);
  std::fill(m, m + gn, kNegInf);
  std::fill(l, l + gn, 0.0f);
  const bool rows_direct = std::is_same_v<Page, c10::BFloat16> && d % kWide == 0;
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(Page));
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(kHeads));
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512i even_odd[2];  // two rows' 32 elements interleaved: the first 16 pairs, then the last 16
  {
    alignas(64) int16_t idx[2][32];
    for (int k = 0; k < 32; ++k) {
      idx[0][k] = static_cast<int16_t>((k & 1) * 32 + k / 2);
      idx[1][k] = static_cast<int16_t>((k & 1) * 32 + 16 + k / 2);
    }
    even_odd[0] = _mm512_load_si512(idx[0]);
    even_odd[1] = _mm512_load_si512(idx[1]);
  }
  walk_tiles(sh, kp, vp, table, base_block, h, first, last, pos, own_k, own_v, krows, vrows,
             [&](int64_t t0, int64_t rows, const Page* const* krows_t, const Page* const* vrows_t,
                 const Page* const* next_k, const Page* const* next_v, int64_t pf_rows) {
    // the next tile's rows into L2 while this one is computed (see score_rows)
    for (int64_t r = 0; r < pf_rows; ++r)
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(next_k[r]) + b, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(next_v[r]) + b, 0, 2);
      }
    // S^T, 16 keys at a time
    for (int64_t r0 = 0; r0 < rows; r0 += kKeys) {
      const int64_t n = std::min(kKeys, rows - r0);
      const char* base = reinterpret_cast<const char*>(kt);
      int64_t stride = dp * 2;
      if (rows_direct && n == kKeys && consecutive(krows_t + r0, sh.s_row)) {
        base = reinterpret_cast<const char*>(krows_t[r0]);  // 16 consecutive rows of the pages
        stride = sh.s_row * 2;
      } else {
        for (int64_t r = 0; r < kKeys; ++r)
          for (int64_t c = 0; c < slices; ++c)
            _mm512_store_si512(kt + r * dp + c * kWide,
                               r < n ? load_bf16<Page>(krows_t[r0 + r] + c * kWide, std::min(kWide, d - c * kWide))
                                     : _mm512_setzero_si512());
      }
      _tile_zero(0);
      for (int64_t c = 0; c < slices; ++c) {
        _tile_loadd(1, base + c * 64, stride);
        _tile_loadd(2, qt + c * kWide / 2 * kWide, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, st + r0 * kHeads, 64);
    }
    // the online softmax per head over its column of S^T; P in bfloat16
    const __mmask16 valid[2] = {static_cast<__mmask16>(rows >= 16 ? 0xffff : (1u << rows) - 1),
                                static_cast<__mmask16>(rows >= 32 ? 0xffff : rows <= 16 ? 0 : (1u << (rows - 16)) - 1)};
    for (int64_t j = 0; j < gn; ++j) {
      __m512 x[2];
      for (int half = 0; half < 2; ++half) {
        x[half] = _mm512_mul_ps(_mm512_i32gather_ps(column, st + half * kKeys * kHeads + j, 4), _mm512_set1_ps(q_mul));
        if (slopes) {
          const float first_rel = static_cast<float>(t0 + half * 16 - pos);
          x[half] = _mm512_fmadd_ps(_mm512_set1_ps(slopes[h * sh.g + j0 + j]),
                                    _mm512_add_ps(iota, _mm512_set1_ps(first_rel)), x[half]);
        }
        x[half] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), valid[half], x[half]);
      }
      const float mx = std::max(m[j], _mm512_reduce_max_ps(_mm512_max_ps(x[0], x[1])));
      if (mx == kNegInf) {  // nothing seen yet (only -inf scores): no weight
        _mm512_store_si512(pt + j * kWide, _mm512_setzero_si512());
        continue;
      }
      const float alpha = std::exp(m[j] - mx);
      const __m512 p0 = Vec(_mm512_sub_ps(x[0], _mm512_set1_ps(mx))).exp_u20();
      const __m512 p1 = Vec(_mm512_sub_ps(x[1], _mm512_set1_ps(mx))).exp_u20();
      l[j] = l[j] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      m[j] = mx;
      _mm512_store_si512(pt + j * kWide, pack_bf16(p0, p1));
      if (alpha != 1.0f)
        for (int64_t i = 0; i < dv; i += kV)
          _mm512_storeu_ps(o + j * dv + i, _mm512_mul_ps(_mm512_loadu_ps(o + j * dv + i), _mm512_set1_ps(alpha)));
    }
    // V pairwise: row i of slice s holds keys 2i and 2i + 1's elements [16 s, 16 s + 16) interleaved
    for (int64_t i = 0; i < kTile / 2; ++i) {
      const int64_t a = 2 * i, b = 2 * i + 1;
      for (int64_t c = 0; c < slices; ++c) {
        const int64_t count = std::min(kWide, d - c * kWide);
        const __m512i va = a < rows ? load_bf16<Page>(vrows_t[a] + c * kWide, count) : _mm512_setzero_si512();
        const __m512i vb = b < rows ? load_bf16<Page>(vrows_t[b] + c * kWide, count) : _mm512_setzero_si512();
        _mm512_store_si512(vt + (2 * c * 16 + i) * kWide, _mm512_permutex2var_epi16(va, even_odd[0], vb));
        if (2 * c + 1 < outs)
          _mm512_store_si512(vt + ((2 * c + 1) * 16 + i) * kWide, _mm512_permutex2var_epi16(va, even_odd[1], vb));
      }
    }
    _tile_loadd(4, pt, 64);
    for (int64_t s = 0; s < outs; ++s) {
      _tile_loadd(3, o + s * kV, dv * 4);
      _tile_loadd(5, vt + s * 16 * kWide, 64);
      _tile_dpbf16ps(3, 4, 5);
      _tile_stored(3, o + s * kV, dv * 4);
    }
  });
  std::copy(o, o + gn * dv, acc);
}

}  // namespace amx
#endif  // CHUNKATTN_AMX

// What the kernel reads besides the pages, one decode s of n per row: its query, its keys [ks[s], ke[s]) through
// its table row, where its output goes and, for a decode whose key is not in the pages, that key's own K/V row.
struct Meta {
  int64_t n = 0, heads = 0, d = 0;
  const float* q = nullptr;             // [n, heads, d] float32
  const int32_t* tables = nullptr;      // [n, width]: physical blocks of logical blocks ks[s] / bs ...
  int64_t width = 0;
  const int64_t* ks = nullptr;          // [n]
  const int64_t* ke = nullptr;          // [n]
  void* out = nullptr;                  // [rows, heads, d] of Out
  const int64_t* out_rows = nullptr;    // [n] decode s's row of out (null: s)
  float* lse = nullptr;                 // [n, heads] natural log, or null
  const void* own_k = nullptr;          // [n, kv_heads, d] of Page: row s is decode s's key where own[s]
  const void* own_v = nullptr;
  const uint8_t* own = nullptr;         // [n], or null: every key is in the pages
};

template <typename Page, typename Out>
void decode_impl(const Meta& mt, const at::Tensor& k_pages, const at::Tensor& v_pages, double scale, double k_scale,
                 double v_scale, const float* slopes, int64_t splits) {
  Shape sh;
  sh.n = mt.n;
  sh.heads = mt.heads;
  sh.d = mt.d;
  sh.dv = (sh.d + kV - 1) / kV * kV;
  sh.kv_heads = k_pages.size(0);
  sh.g = sh.heads / sh.kv_heads;
  sh.bs = k_pages.size(2);
  sh.width = mt.width;
  sh.s_head = k_pages.stride(0);
  sh.s_block = k_pages.stride(1);
  sh.s_row = k_pages.stride(2);
  const float* qp = mt.q;
  const Page* kp = reinterpret_cast<const Page*>(k_pages.data_ptr());
  const Page* vp = reinterpret_cast<const Page*>(v_pages.data_ptr());
  const int32_t* tp = mt.tables;
  const int64_t* ks = mt.ks;
  const int64_t* ke = mt.ke;
  Out* op = reinterpret_cast<Out*>(mt.out);
  float* lp = mt.lse;
  const Page* own_k = reinterpret_cast<const Page*>(mt.own_k);
  const Page* own_v = reinterpret_cast<const Page*>(mt.own_v);
  auto out_row = [&](int64_t s) { return mt.out_rows ? mt.out_rows[s] : s; };
  // scores are (q . k_raw) * k_raw_scale * k_scale * scale; outputs sum(p v_raw) * v_raw_scale * v_scale / l.
  // ALiBi is added after the scale, so the query carries all of it.
  const float q_mul = static_cast<float>(scale * k_scale) * kRawScale<Page>;
  const float v_mul = static_cast<float>(v_scale) * kRawScale<Page>;
  const int64_t g = sh.g, d = sh.d, dv = sh.dv, tasks = sh.n * sh.kv_heads;

  // With splits > 1 each task's keys are cut in `splits` parts (whole tiles each); the parts' normalized
  // outputs and log-sum-exps go to part_out / part_lse and are merged below.
  std::vector<float> part_out(splits > 1 ? tasks * splits * g * dv : 0);
  std::vector<float> part_lse(splits > 1 ? tasks * splits * g : 0);

#if defined(CHUNKATTN_AMX)
  // A bfloat16 compute over bfloat16 and float8 caches on the AMX tiles, where a task has enough query heads per
  // KV head to fill them (amx::kMinHeads) and Linux gave us them.
  constexpr bool kTiles = amx::kServes<Page> && std::is_same_v<Out, c10::BFloat16>;
  const int mode = amx::mode;
  const bool tiles = kTiles && (mode == amx::kAlways || (mode == amx::kAuto && g >= amx::kMinHeads<Page>));
#else
  constexpr bool kTiles = false;
  const bool tiles = false;
#endif

  at::parallel_for(0, tasks * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(g * dv, 0.0f), acc(g * dv), m(g), l(g), scores(g * kTile);
    std::vector<const Page*> krows(2 * kTile), vrows(2 * kTile);
#if defined(CHUNKATTN_AMX)
    std::optional<amx::Buffers> buffers;
    std::optional<TileScope> scope;
    if (tiles) {
      buffers.emplace(d, dv);
      scope.emplace();
    }
#endif
    for (int64_t work = begin; work < end; ++work) {
      const int64_t task = work / splits, part = work % splits;
      const int64_t s = task / sh.kv_heads, h = task % sh.kv_heads;
      const int64_t first = ks[s], last = ke[s];
      int64_t lo = first, hi = last;
      if (splits > 1) {
        const int64_t tiles = (last - first + kTile - 1) / kTile;
        lo = std::min(last, first + (tiles * part / splits) * kTile);
        hi = std::min(last, first + (tiles * (part + 1) / splits) * kTile);
      }
      const bool own = mt.own != nullptr && mt.own[s];
      const int64_t own_off = s * sh.kv_heads * d;
      const float* q = qp + (s * sh.heads + h * g) * d;
      if constexpr (kTiles) {
#if defined(CHUNKATTN_AMX)
        if (tiles) {
          for (int64_t j0 = 0; j0 < g; j0 += amx::kHeads)
            amx::attend_range<Page>(sh, kp, vp, tp + s * sh.width, first / sh.bs, q, q_mul, j0,
                                    std::min(amx::kHeads, g - j0), h, lo, hi, last - 1, slopes, acc.data() + j0 * dv,
                                    m.data() + j0, l.data() + j0, *buffers, krows.data(), vrows.data(),
                                    own ? own_k + own_off : nullptr, own ? own_v + own_off : nullptr);
        }
#endif
      }
      if (!tiles) {
        for (int64_t j = 0; j < g; ++j)
          for (int64_t i = 0; i < d; ++i) qs[j * dv + i] = q[j * d + i] * q_mul;
        attend_range<Page>(sh, kp, vp, tp + s * sh.width, first / sh.bs, qs.data(), h, lo, hi, last - 1, slopes,
                           acc.data(), m.data(), l.data(), scores.data(), krows.data(), vrows.data(),
                           own ? own_k + own_off : nullptr, own ? own_v + own_off : nullptr);
      }
      for (int64_t j = 0; j < g; ++j) {
        const float inv = l[j] > 0 ? v_mul / l[j] : 0.0f;
        const float lse_j = l[j] > 0 ? m[j] + std::log(l[j]) : kNegInf;
        if (splits == 1) {
          Out* dst = op + (out_row(s) * sh.heads + h * g + j) * d;
          for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<Out>(acc[j * dv + i] * inv);
          if (lp) lp[s * sh.heads + h * g + j] = lse_j;
        } else {
          float* dst = part_out.data() + (work * g + j) * dv;
          for (int64_t i = 0; i < d; ++i) dst[i] = acc[j * dv + i] * inv;
          part_lse[work * g + j] = lse_j;
        }
      }
    }
  });
  if (splits == 1) return;
  at::parallel_for(0, tasks * g, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(d);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t task = w / g, j = w % g;
      const int64_t s = task / sh.kv_heads, h = task % sh.kv_heads;
      float mx = kNegInf;
      for (int64_t p = 0; p < splits; ++p) mx = std::max(mx, part_lse[(task * splits + p) * g + j]);
      std::fill(sum.begin(), sum.end(), 0.0f);
      float total = 0.0f;
      if (mx != kNegInf) {
        for (int64_t p = 0; p < splits; ++p) {
          const float wgt = std::exp(part_lse[(task * splits + p) * g + j] - mx);
          if (wgt == 0.0f) continue;
          const float* src = part_out.data() + ((task * splits + p) * g + j) * dv;
          for (int64_t i = 0; i < d; ++i) sum[i] += wgt * src[i];
          total += wgt;
        }
      }
      const float inv = total > 0 ? 1.0f / total : 0.0f;
      Out* dst = op + (out_row(s) * sh.heads + h * g + j) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<Out>(sum[i] * inv);
      if (lp) lp[s * sh.heads + h * g + j] = total > 0 ? mx + std::log(total) : kNegInf;
    }
  });
}

template <typename Out>
void dispatch_pages(const Meta& mt, const at::Tensor& k_pages, const at::Tensor& v_pages, double scale,
                    double k_scale, double v_scale, const float* slopes, int64_t splits) {
#define CHUNKATTN_DECODE(PAGE) return decode_impl<PAGE, Out>(mt, k_pages, v_pages, scale, k_scale, v_scale, slopes, splits)
  switch (k_pages.scalar_type()) {
    case at::kFloat: CHUNKATTN_DECODE(float);
    case at::kBFloat16: CHUNKATTN_DECODE(c10::BFloat16);
    case at::kHalf: CHUNKATTN_DECODE(c10::Half);
    case at::kFloat8_e4m3fn: CHUNKATTN_DECODE(E4M3);
    case at::kFloat8_e5m2: CHUNKATTN_DECODE(E5M2);
    default:
      TORCH_CHECK(false, "chunkattn native decode: pages of dtype ", k_pages.scalar_type(), " are not served");
  }
#undef CHUNKATTN_DECODE
}

void run_decodes(const Meta& mt, at::ScalarType out_type, const at::Tensor& k_pages, const at::Tensor& v_pages,
                 double scale, double k_scale, double v_scale, const float* slopes, int64_t splits) {
  switch (out_type) {
    case at::kFloat: return dispatch_pages<float>(mt, k_pages, v_pages, scale, k_scale, v_scale, slopes, splits);
    case at::kBFloat16:
      return dispatch_pages<c10::BFloat16>(mt, k_pages, v_pages, scale, k_scale, v_scale, slopes, splits);
    case at::kHalf: return dispatch_pages<c10::Half>(mt, k_pages, v_pages, scale, k_scale, v_scale, slopes, splits);
    default:
      TORCH_CHECK(false, "chunkattn native decode: outputs of dtype ", out_type, " are not served");
  }
}

void check_pages(const at::Tensor& k_pages, const at::Tensor& v_pages, int64_t d) {
  TORCH_CHECK(k_pages.dim() == 4 && k_pages.size(3) == d, "pages must be [Hkv, blocks, bs, D]");
  TORCH_CHECK(k_pages.stride(3) == 1 && v_pages.stride(3) == 1, "page rows must be contiguous");
  TORCH_CHECK(k_pages.strides() == v_pages.strides() && k_pages.sizes() == v_pages.sizes() &&
                  k_pages.scalar_type() == v_pages.scalar_type(), "K and V pages must share a layout");
  TORCH_CHECK(k_pages.size(0) > 0, "pages must have KV heads");
}

// Every block the kernel will read is in the pages: O(S x W), nothing next to the attention. A decode with its
// own key row reads the pages for its keys before that one only.
void check_tables(const Meta& mt, int64_t blocks, int64_t bs) {
  for (int64_t s = 0; s < mt.n; ++s) {
    const int64_t ks = mt.ks[s], ke = mt.ke[s];
    const int64_t paged_end = mt.own != nullptr && mt.own[s] ? ke - 1 : ke;
    TORCH_CHECK(0 <= ks && ks < ke, "decode ", s, ": keys [", ks, ", ", ke, ") are empty");
    if (paged_end <= ks) continue;
    TORCH_CHECK((paged_end - 1) / bs - ks / bs < mt.width, "decode ", s, ": keys [", ks, ", ", paged_end,
                ") do not fit a table of ", mt.width, " blocks");
    for (int64_t b = 0; b <= (paged_end - 1) / bs - ks / bs; ++b)
      TORCH_CHECK(0 <= mt.tables[s * mt.width + b] && mt.tables[s * mt.width + b] < blocks, "decode ", s,
                  ": block ", mt.tables[s * mt.width + b], " is not in the pages (", blocks, " blocks)");
  }
}

const float* slopes_of(const c10::optional<at::Tensor>& alibi, int64_t heads) {
  TORCH_CHECK(!alibi.has_value() || (alibi->scalar_type() == at::kFloat && alibi->is_contiguous() &&
                                     alibi->numel() == heads), "alibi slopes must be float32 [H]");
  return alibi.has_value() ? alibi->data_ptr<float>() : nullptr;
}

// One decode's table: the physical blocks of logical blocks [first, last) of a sequence's table, a dict
// {logical: physical} (the sequence API) or an int64 array indexed by logical block (the block API's rows).
void table_row(const py::handle& table, int64_t first, int64_t last, int32_t* dst, int64_t s) {
  if (PyDict_Check(table.ptr())) {
    for (int64_t b = first; b < last; ++b) {
      py::int_ key(b);
      PyObject* found = PyDict_GetItem(table.ptr(), key.ptr());  // borrowed
      TORCH_CHECK(found != nullptr, "decode ", s, ": its table has no logical block ", b);
      dst[b - first] = static_cast<int32_t>(PyLong_AsLongLong(found));
    }
    return;
  }
  auto array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(table);
  TORCH_CHECK(array && array.ndim() == 1, "decode ", s, ": a table must be a dict or a 1-d int64 array");
  TORCH_CHECK(last <= array.shape(0), "decode ", s, ": its table has ", array.shape(0), " blocks; logical block ",
              last - 1, " is needed");
  const int64_t* p = array.data();
  for (int64_t b = first; b < last; ++b) dst[b - first] = static_cast<int32_t>(p[b]);
}

}  // namespace

// q [S, H, D] float32 (scaled inside; with a bfloat16 out its values are the compute's bfloat16 ones, which the
// AMX tiles take as they are); pages [Hkv, num_blocks, bs, D] (float32, bfloat16, float16, float8
// e4m3fn / e5m2 read as stored * k_scale or v_scale); tables [S, W] int32; key_start, key_end [S] int64;
// out [S, H, D] of float32, bfloat16 or float16; lse [S, H] float32 (natural log); splits: parts per
// sequence's keys (1: none; see split_for).
void decode(at::Tensor q, at::Tensor k_pages, at::Tensor v_pages, at::Tensor tables, at::Tensor key_start,
            at::Tensor key_end, at::Tensor out, at::Tensor lse, double scale, double k_scale, double v_scale,
            c10::optional<at::Tensor> alibi, int64_t splits) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q must be contiguous [S, H, D] float32");
  check_pages(k_pages, v_pages, q.size(2));
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() && tables.size(0) == q.size(0),
              "tables must be contiguous int32 [S, W]");
  TORCH_CHECK(key_start.scalar_type() == at::kLong && key_end.scalar_type() == at::kLong &&
                  key_start.is_contiguous() && key_end.is_contiguous(), "key ranges must be contiguous int64");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous, q's shape");
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat, "lse must be contiguous float32");
  TORCH_CHECK(q.size(1) % k_pages.size(0) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(tables.dim() == 2 && key_start.numel() == q.size(0) && key_end.numel() == q.size(0),
              "tables must be [S, W] and key ranges [S]");
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1), "lse must be [S, H]");
  TORCH_CHECK(splits >= 1, "splits must be >= 1");
  Meta mt;
  mt.n = q.size(0);
  mt.heads = q.size(1);
  mt.d = q.size(2);
  mt.q = q.data_ptr<float>();
  mt.tables = tables.data_ptr<int32_t>();
  mt.width = tables.size(1);
  mt.ks = key_start.data_ptr<int64_t>();
  mt.ke = key_end.data_ptr<int64_t>();
  mt.out = out.data_ptr();
  mt.lse = lse.data_ptr<float>();
  check_tables(mt, k_pages.size(1), k_pages.size(2));
  const float* slopes = slopes_of(alibi, q.size(1));
  run_decodes(mt, out.scalar_type(), k_pages, v_pages, scale, k_scale, v_scale, slopes, splits);
}

// How many parts to cut each decode's keys into so that all threads have work: 1 when sequences x KV heads
// already give every thread a few tasks; else enough parts for ~4 tasks per thread, no part under 256 keys.
int64_t split_for(int64_t seqs, int64_t kv_heads, int64_t longest) {
  const int64_t threads = at::get_num_threads();
  const int64_t tasks = seqs * kv_heads;
  if (tasks >= 4 * threads) return 1;
  const int64_t wanted = (4 * threads + tasks - 1) / tasks;
  return std::max<int64_t>(1, std::min<int64_t>(wanted, longest / 256));
}

// A step's decodes in one call, their K/V stored first. q [T, H, D] (float32, bfloat16 or float16, the compute
// dtype); k, v [T, Hkv, D] (the compute dtype) or None; slots [T] int64 or None (no store): row t of k and v is
// stored at slots[t] (-1: not written), a float8 page as k / k_scale (v / v_scale) saturated and rounded as
// torchtypes.store does; spans: per span (its row of q, its position, its tokens); tables: per span a dict
// {logical: physical block} or an int64 array by logical block; which: the spans to compute (each one token),
// None: every span; unwritten: those of them (ascending) whose key is not in the pages: row `row` of k and v,
// converted as the pages would hold it, is their last key. A span at position p sees keys [p - p % C, p]
// (C = chunk_size; 0: [0, p]). out [T, H, D] (the compute dtype): the decodes' rows are written. Everything is
// checked, and the metadata built from the Python objects, with the GIL held and before any write; the store
// and the kernel run without the GIL.
void store_and_decode(at::Tensor q, c10::optional<at::Tensor> k, c10::optional<at::Tensor> v,
                      c10::optional<at::Tensor> slots, at::Tensor k_pages, at::Tensor v_pages,
                      const std::vector<std::tuple<int64_t, int64_t, int64_t>>& spans, py::sequence tables,
                      const c10::optional<std::vector<int64_t>>& which, const std::vector<int64_t>& unwritten,
                      int64_t chunk_size, at::Tensor out, double scale, double k_scale, double v_scale,
                      c10::optional<at::Tensor> alibi) {
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf),
              "q must be contiguous [T, H, D] float32, bfloat16 or float16");
  check_pages(k_pages, v_pages, d);
  const int64_t hkv = k_pages.size(0), blocks = k_pages.size(1), bs = k_pages.size(2);
  TORCH_CHECK(heads % hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous, q's shape");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out must be q's dtype (the compute dtype), not ",
              out.scalar_type());
  TORCH_CHECK(chunk_size >= 0, "chunk_size must be >= 0");
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == static_cast<int64_t>(spans.size()),
              "one table per span: ", tables.size(), " tables for ", spans.size(), " spans");
  const bool stores = slots.has_value();
  const bool has_kv = k.has_value() && v.has_value();
  TORCH_CHECK(!stores || has_kv, "slots need k and v");
  if (has_kv) {
    for (const at::Tensor* t : {&*k, &*v})
      TORCH_CHECK(t->is_contiguous() && t->dim() == 3 && t->size(0) == rows && t->size(1) == hkv && t->size(2) == d &&
                      t->scalar_type() == k->scalar_type(), "k and v must be contiguous [T, Hkv, D] of one dtype");
  }
  if (stores) {
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->is_contiguous() && slots->numel() == rows,
                "slots must be contiguous int64 [T]");
    const int64_t* sp = slots->data_ptr<int64_t>();
    for (int64_t t = 0; t < rows; ++t)
      TORCH_CHECK(sp[t] < blocks * bs, "slot ", sp[t], " of row ", t, " is not in the pages (", blocks * bs, " slots)");
  }
  std::vector<int64_t> decodes;  // the spans computed here: `which`, or every span
  if (which.has_value()) {
    decodes = *which;
  } else {
    decodes.resize(spans.size());
    for (size_t i = 0; i < spans.size(); ++i) decodes[i] = static_cast<int64_t>(i);
  }
  const int64_t n = static_cast<int64_t>(decodes.size());
  std::vector<uint8_t> own(n, 0);
  std::vector<int64_t> own_at(has_kv ? rows : 0, -1);  // per row of k / v, its decode's own row (or -1)
  {
    size_t u = 0;  // unwritten: ascending span indices, each one of decodes
    for (int64_t s = 0; s < n && u < unwritten.size(); ++s)
      if (decodes[s] == unwritten[u]) {
        own[s] = 1;
        ++u;
      }
    TORCH_CHECK(u == unwritten.size(), "unwritten spans must be decodes, ascending");
    TORCH_CHECK(u == 0 || has_kv, "a decode whose key is not written needs k and v");
  }
  // Per decode: its row, its keys [start, end) (its chunk's start to its own key), its table row.
  std::vector<int64_t> ks(n), ke(n), out_rows(n);
  int64_t width = 1;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t e = decodes[s];
    TORCH_CHECK(0 <= e && e < static_cast<int64_t>(spans.size()), "decode ", s, ": span ", e, " does not exist");
    const auto [row, position, count] = spans[e];
    TORCH_CHECK(count == 1 && 0 <= row && row < rows && position >= 0, "decode ", s, ": span ", e,
                " is not one token of q");
    ks[s] = chunk_size ? position - position % chunk_size : 0;
    ke[s] = position + 1;
    out_rows[s] = row;
    if (own[s]) {
      TORCH_CHECK(!stores || slots->data_ptr<int64_t>()[row] < 0, "decode ", s, " has a slot: its key is written");
      own_at[row] = s;
    }
    const int64_t paged_end = own[s] ? position : position + 1;
    if (paged_end > ks[s]) width = std::max(width, (paged_end - 1) / bs - ks[s] / bs + 1);
  }
  std::vector<int32_t> table(n * width, 0);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t paged_end = own[s] ? ke[s] - 1 : ke[s];
    if (paged_end > ks[s])
      table_row(tables[decodes[s]], ks[s] / bs, (paged_end - 1) / bs + 1, table.data() + s * width, s);
  }
  const float* slopes = slopes_of(alibi, heads);
  Meta mt;
  mt.n = n;
  mt.heads = heads;
  mt.d = d;
  mt.tables = table.data();
  mt.width = width;
  mt.ks = ks.data();
  mt.ke = ke.data();
  mt.out = out.data_ptr();
  mt.out_rows = out_rows.data();
  mt.own = own.data();
  check_tables(mt, blocks, bs);
  int64_t longest = 0;
  for (int64_t s = 0; s < n; ++s) longest = std::max(longest, ke[s] - ks[s]);

  py::gil_scoped_release nogil;
  // The decodes' own K/V rows (those not written), as the pages would hold them.
  const int64_t page_bytes = k_pages.element_size();
  std::vector<uint8_t> own_k(unwritten.empty() ? 0 : n * hkv * d * page_bytes);
  std::vector<uint8_t> own_v(own_k.size());
  if (has_kv && (stores || !unwritten.empty())) {
    std::vector<int64_t> none(stores ? 0 : rows, -1);
    store_rows(*k, *v, k_pages, v_pages, stores ? slots->data_ptr<int64_t>() : none.data(), rows, k_scale,
               v_scale, own_k.empty() ? nullptr : own_k.data(), own_v.empty() ? nullptr : own_v.data(),
               unwritten.empty() ? nullptr : own_at.data());
  }
  if (n == 0) return;
  mt.own_k = own_k.empty() ? nullptr : own_k.data();
  mt.own_v = own_v.empty() ? nullptr : own_v.data();
  // Each decode's query as float32 [n, H, D], in decode order.
  std::vector<float> qf(n * heads * d);
  const int64_t qrow = heads * d;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "chunkattn_q", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    for (int64_t s = 0; s < n; ++s) {
      const scalar_t* src = qp + out_rows[s] * qrow;
      for (int64_t i = 0; i < qrow; ++i) qf[s * qrow + i] = static_cast<float>(src[i]);
    }
  });
  mt.q = qf.data();
  run_decodes(mt, out.scalar_type(), k_pages, v_pages, scale, k_scale, v_scale, slopes,
              split_for(n, hkv, longest));
}

namespace chunkattn {
void bind_prefill(pybind11::module_& m);  // prefill.cpp
}  // namespace chunkattn

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while the kernel runs (its arguments are converted first): other Python threads, the
  // server's gRPC handlers, go on meanwhile, as they do around torch's own ops.
  m.def("decode", &decode, py::call_guard<py::gil_scoped_release>(),
        "every decode of a step over the paged cache (see decode.cpp)");
  m.def("split_for", &split_for, "parts per decode's keys for a step of seqs x kv_heads tasks");
  // The metadata is read from Python objects first; the GIL is released for the store and the kernel.
  m.def("store_and_decode", &store_and_decode,
        "store a step's K/V at their slots (float8: over the scales), then every decode of the step (decode.cpp)");
  chunkattn::bind_prefill(m);
#if defined(CHUNKATTN_AMX)
  amx::ready = tiles_granted();
  amx::mode = amx::ready ? amx::kAuto : amx::kNever;
#endif
  m.def(
      "use_tiles",
      [](const std::string& when) {
        static const char* names[] = {"never", "auto", "always"};
        int want = -1;
        for (int i = 0; i < 3; ++i)
          if (when == names[i]) want = i;
        TORCH_CHECK(want >= 0, "use_tiles: expected 'never', 'auto' or 'always', got '", when, "'");
#if defined(CHUNKATTN_AMX)
        TORCH_CHECK(want == amx::kNever || amx::ready, "use_tiles: this process has no AMX tiles");
        return std::string(names[amx::mode.exchange(want)]);
#else
        TORCH_CHECK(want == 0, "use_tiles: this build has no AMX path");
        return std::string("never");
#endif
      },
      "when this process's bfloat16 decodes over bfloat16 and float8 caches take the AMX tiles: 'never', 'auto'"
      " (from amx_min_heads query heads per KV head: the default where granted) or 'always'; returns the mode"
      " before");
  // Whether bfloat16 decodes over bfloat16 and float8 caches run on the AMX tiles (the AMX build, where Linux
  // gave this process the tiles' state); False: on the vector units. amx_min_heads: per page dtype, the fewest
  // query heads per KV head that take the tiles (fewer: the vector units).
  py::dict min_heads;
#if defined(CHUNKATTN_AMX)
  m.attr("amx") = py::bool_(amx::ready);
  min_heads["bfloat16"] = amx::kMinHeads<c10::BFloat16>;
  min_heads["float8_e4m3fn"] = amx::kMinHeads<E4M3>;
  min_heads["float8_e5m2"] = amx::kMinHeads<E5M2>;
#else
  m.attr("amx") = py::bool_(false);
#endif
  m.attr("amx_min_heads") = min_heads;
}

// chunkattn's native CPU decode kernel: every decode of a step in one call, reading the paged cache through
// the block table (no gather), all query heads of one KV head together (each K/V row read once), float32
// accumulation, float8 pages read with their scales, ALiBi. Built per ISA (the file is compiled with the
// flags of each: at::vec::Vectorized is as wide as they allow) and chosen at run time (native/build.py).
//
// A decode s of the step: its one query q[s] [H, D] at absolute position pos[s] sees the keys
// [key_start[s], key_end[s]) (key_end = pos + 1: its own key is in the cache already), which live in the
// pages at physical block tables[s][(key - key_start[s] + first_offset[s]) / block_size]... written as: the
// key at absolute position p is in block tables[s][p / bs - key_start[s] / bs], row p % bs.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kHeadsAtOnce = 8;  // query heads scored together (their accumulators stay in registers)

// float8 codes to floats (e4m3fn and e5m2): 256-entry tables, made once.
struct Fp8Tables {
  float e4m3[256];
  float e5m2[256];
  Fp8Tables() {
    for (int i = 0; i < 256; ++i) {
      const float sign = (i & 0x80) ? -1.0f : 1.0f;
      {  // e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff NaN
        const int e = (i >> 3) & 0xf, m = i & 0x7;
        float v;
        if (e == 0xf && m == 0x7) v = std::numeric_limits<float>::quiet_NaN();
        else if (e == 0) v = std::ldexp(static_cast<float>(m) / 8.0f, -6);
        else v = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
        e4m3[i] = sign * v;
      }
      {  // e5m2: 5 exponent bits (bias 15), 2 mantissa bits
        const int e = (i >> 2) & 0x1f, m = i & 0x3;
        float v;
        if (e == 0x1f) v = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
        else if (e == 0) v = std::ldexp(static_cast<float>(m) / 4.0f, -14);
        else v = std::ldexp(1.0f + static_cast<float>(m) / 4.0f, e - 15);
        e5m2[i] = sign * v;
      }
    }
  }
};

const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables;
  return tables;
}

// One row of D elements of the page dtype, as floats (times ``scale`` for float8). Plain loops: the compiler
// vectorizes them with the file's ISA flags.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t d, float /*scale*/, const float* /*lut*/);

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t d, float, const float*) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;  // bfloat16: float's top half
}

template <>
inline void load_row<c10::Half>(const c10::Half* src, float* dst, int64_t d, float, const float*) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_row<float>(const float* src, float* dst, int64_t d, float, const float*) {
  std::memcpy(dst, src, sizeof(float) * d);
}

template <>
inline void load_row<uint8_t>(const uint8_t* src, float* dst, int64_t d, float scale, const float* lut) {
  for (int64_t i = 0; i < d; ++i) dst[i] = lut[src[i]] * scale;
}

// acc = acc * alpha + w * v
inline void scale_add(float* acc, float alpha, float w, const float* v, int64_t d) {
  const Vec va(alpha), vw(w);
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size())
    at::vec::fmadd(Vec::loadu(acc + i), va, vw * Vec::loadu(v + i)).store(acc + i);
  for (; i < d; ++i) acc[i] = acc[i] * alpha + w * v[i];
}

template <typename Page, typename Out>
void decode_impl(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                 const at::Tensor& tables, const at::Tensor& key_start, const at::Tensor& key_end,
                 const at::Tensor& out, const at::Tensor& lse, double scale, double k_scale, double v_scale,
                 const c10::optional<at::Tensor>& alibi, const float* lut) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_pages.size(0), bs = k_pages.size(2);
  const int64_t g = heads / kv_heads;
  const int64_t width = tables.size(1);
  const float* qp = q.data_ptr<float>();
  const Page* kp = reinterpret_cast<const Page*>(k_pages.data_ptr());
  const Page* vp = reinterpret_cast<const Page*>(v_pages.data_ptr());
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t* ks = key_start.data_ptr<int64_t>();
  const int64_t* ke = key_end.data_ptr<int64_t>();
  Out* op = reinterpret_cast<Out*>(out.data_ptr());
  float* lp = lse.data_ptr<float>();
  const float* slopes = alibi.has_value() ? alibi->data_ptr<float>() : nullptr;
  // strides of the pages [Hkv, num_blocks, bs, D] (rows contiguous)
  const int64_t s_head = k_pages.stride(0), s_block = k_pages.stride(1), s_row = k_pages.stride(2);
  const float fk = static_cast<float>(k_scale), fv = static_cast<float>(v_scale), fs = static_cast<float>(scale);

  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(g * d), acc(g * d), krow(d), vrow(d), kt(d * bs), scores(g * bs), m(g), l(g);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      const int64_t first = ks[s], last = ke[s], pos = last - 1;
      for (int64_t j = 0; j < g; ++j) {
        const float* src = qp + (s * heads + h * g + j) * d;
        for (int64_t i = 0; i < d; ++i) qs[j * d + i] = src[i] * fs;
        m[j] = -std::numeric_limits<float>::infinity();
        l[j] = 0.0f;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      const int64_t base_block = first / bs;
      for (int64_t start = first; start < last;) {
        const int64_t logical = start / bs;
        const int64_t stop = std::min(last, (logical + 1) * bs);
        const int64_t block = tp[s * width + (logical - base_block)];
        const Page* kb = kp + h * s_head + block * s_block;
        const Page* vb = vp + h * s_head + block * s_block;
        const int64_t rows = stop - start;
        // The block's K rows as floats, transposed (kt[i * bs + r]: element i of row r): a query head's scores
        // are then vectors over rows, each K element read once for all the KV head's query heads.
        for (int64_t r = 0; r < rows; ++r) {
          load_row<Page>(kb + (start + r - logical * bs) * s_row, krow.data(), d, fk, lut);
          for (int64_t i = 0; i < d; ++i) kt[i * bs + r] = krow[i];
        }
        for (int64_t j0 = 0; j0 < g; j0 += kHeadsAtOnce) {
          const int64_t gn = std::min<int64_t>(kHeadsAtOnce, g - j0);
          int64_t r = 0;
          for (; r + Vec::size() <= rows; r += Vec::size()) {
            Vec a[kHeadsAtOnce];
            for (int64_t j = 0; j < gn; ++j) a[j] = Vec(0.0f);
            for (int64_t i = 0; i < d; ++i) {
              const Vec kv = Vec::loadu(kt.data() + i * bs + r);
              for (int64_t j = 0; j < gn; ++j) a[j] = at::vec::fmadd(Vec(qs[(j0 + j) * d + i]), kv, a[j]);
            }
            for (int64_t j = 0; j < gn; ++j) a[j].store(scores.data() + (j0 + j) * bs + r);
          }
          for (; r < rows; ++r) {
            for (int64_t j = 0; j < gn; ++j) {
              float x = 0.0f;
              for (int64_t i = 0; i < d; ++i) x += qs[(j0 + j) * d + i] * kt[i * bs + r];
              scores[(j0 + j) * bs + r] = x;
            }
          }
        }
        if (slopes) {
          for (int64_t j = 0; j < g; ++j)
            for (int64_t r = 0; r < rows; ++r) scores[j * bs + r] += slopes[h * g + j] * static_cast<float>(start + r - pos);
        }
        for (int64_t j = 0; j < g; ++j) {  // online softmax over the block's rows
          float mx = m[j];
          for (int64_t r = 0; r < rows; ++r) mx = std::max(mx, scores[j * bs + r]);
          const float alpha = std::exp(m[j] - mx);
          l[j] *= alpha;
          for (int64_t i = 0; i < d; ++i) acc[j * d + i] *= alpha;
          for (int64_t r = 0; r < rows; ++r) {
            const float p = std::exp(scores[j * bs + r] - mx);
            scores[j * bs + r] = p;
            l[j] += p;
          }
          m[j] = mx;
        }
        for (int64_t r = 0; r < rows; ++r) {
          load_row<Page>(vb + (start + r - logical * bs) * s_row, vrow.data(), d, fv, lut);
          for (int64_t j = 0; j < g; ++j) scale_add(acc.data() + j * d, 1.0f, scores[j * bs + r], vrow.data(), d);
        }
        start = stop;
      }
      for (int64_t j = 0; j < g; ++j) {
        const float inv = l[j] > 0 ? 1.0f / l[j] : 0.0f;
        Out* dst = op + (s * heads + h * g + j) * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<Out>(acc[j * d + i] * inv);
        lp[s * heads + h * g + j] = l[j] > 0 ? m[j] + std::log(l[j]) : -std::numeric_limits<float>::infinity();
      }
    }
  });
}

template <typename Out>
void dispatch_pages(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                    const at::Tensor& tables, const at::Tensor& key_start, const at::Tensor& key_end,
                    const at::Tensor& out, const at::Tensor& lse, double scale, double k_scale, double v_scale,
                    const c10::optional<at::Tensor>& alibi) {
  switch (k_pages.scalar_type()) {
    case at::kFloat:
      return decode_impl<float, Out>(q, k_pages, v_pages, tables, key_start, key_end, out, lse, scale, 1.0, 1.0, alibi, nullptr);
    case at::kBFloat16:
      return decode_impl<c10::BFloat16, Out>(q, k_pages, v_pages, tables, key_start, key_end, out, lse, scale, 1.0, 1.0, alibi, nullptr);
    case at::kHalf:
      return decode_impl<c10::Half, Out>(q, k_pages, v_pages, tables, key_start, key_end, out, lse, scale, 1.0, 1.0, alibi, nullptr);
    case at::kFloat8_e4m3fn:
      return decode_impl<uint8_t, Out>(q, k_pages, v_pages, tables, key_start, key_end, out, lse, scale, k_scale, v_scale, alibi, fp8_tables().e4m3);
    case at::kFloat8_e5m2:
      return decode_impl<uint8_t, Out>(q, k_pages, v_pages, tables, key_start, key_end, out, lse, scale, k_scale, v_scale, alibi, fp8_tables().e5m2);
    default:
      TORCH_CHECK(false, "chunkattn native decode: pages of dtype ", k_pages.scalar_type(), " are not served");
  }
}

}  // namespace

// q [S, H, D] float32 (scaled inside); pages [Hkv, num_blocks, bs, D]; tables [S, W] int32; key_start, key_end
// [S] int64; out [S, H, D] of float32, bfloat16 or float16; lse [S, H] float32 (natural log).
void decode(at::Tensor q, at::Tensor k_pages, at::Tensor v_pages, at::Tensor tables, at::Tensor key_start,
            at::Tensor key_end, at::Tensor out, at::Tensor lse, double scale, double k_scale, double v_scale,
            c10::optional<at::Tensor> alibi) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32");
  TORCH_CHECK(k_pages.stride(3) == 1 && v_pages.stride(3) == 1, "page rows must be contiguous");
  TORCH_CHECK(k_pages.strides() == v_pages.strides(), "K and V pages must share a layout");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous(), "tables must be contiguous int32");
  TORCH_CHECK(out.is_contiguous() && lse.is_contiguous() && lse.scalar_type() == at::kFloat, "bad out or lse");
  TORCH_CHECK(q.size(1) % k_pages.size(0) == 0, "query heads must be a multiple of KV heads");
  switch (out.scalar_type()) {
    case at::kFloat:
      return dispatch_pages<float>(q, k_pages, v_pages, tables, key_start, key_end, out, lse, scale, k_scale, v_scale, alibi);
    case at::kBFloat16:
      return dispatch_pages<c10::BFloat16>(q, k_pages, v_pages, tables, key_start, key_end, out, lse, scale, k_scale, v_scale, alibi);
    case at::kHalf:
      return dispatch_pages<c10::Half>(q, k_pages, v_pages, tables, key_start, key_end, out, lse, scale, k_scale, v_scale, alibi);
    default:
      TORCH_CHECK(false, "chunkattn native decode: outputs of dtype ", out.scalar_type(), " are not served");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "every decode of a step over the paged cache (see decode.cpp)");
}

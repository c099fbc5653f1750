// The store: rows of k / v (the compute dtype) into pages (the cache dtype), float8 over the layer's scales as
// torchtypes.store rounds them; shared by the native kernels (decode.cpp, prefill.cpp).
#pragma once

#include "pages.h"

namespace chunkattn {


// x as a cache of type Page holds it: a plain conversion (round to nearest even), or for float8 x / scale in
// float32, saturated to the format's largest finite value, rounded to nearest even: torchtypes.store, bit for bit.
template <typename Page> constexpr float kTop = 0.0f;  // the float8 formats' largest finite values
template <> constexpr float kTop<E4M3> = 448.0f;
template <> constexpr float kTop<E5M2> = 57344.0f;

template <typename Page> inline Page to_page(float x, float scale);
template <> inline float to_page<float>(float x, float) { return x; }
template <> inline c10::BFloat16 to_page<c10::BFloat16>(float x, float) { return c10::BFloat16(x); }
template <> inline c10::Half to_page<c10::Half>(float x, float) { return c10::Half(x); }
template <> inline E4M3 to_page<E4M3>(float x, float scale) {
  const float y = scale != 1.0f ? x / scale : x;
  return E4M3{c10::Float8_e4m3fn(std::min(std::max(y, -kTop<E4M3>), kTop<E4M3>)).x};
}
template <> inline E5M2 to_page<E5M2>(float x, float scale) {
  const float y = scale != 1.0f ? x / scale : x;
  return E5M2{c10::Float8_e5m2(std::min(std::max(y, -kTop<E5M2>), kTop<E5M2>)).x};
}

// Converts `count` elements of src (Src) into dst (Page) over scale.
template <typename Src, typename Page>
inline void convert_row(const Src* src, Page* dst, int64_t count, float scale) {
  for (int64_t i = 0; i < count; ++i) dst[i] = to_page<Page>(static_cast<float>(src[i]), scale);
}

// rows[i] of k, v [T, Hkv, D] (Src) stored at slots[i] of the pages (Page), or into own_k / own_v [n, Hkv, D]
// (Page) at own_at[i] where slots[i] < 0 and own_at[i] >= 0 (a decode whose key is not written).
template <typename Src, typename Page>
void store_impl(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pages, const at::Tensor& v_pages,
                const int64_t* slots, int64_t count, double k_scale, double v_scale, Page* own_k, Page* own_v,
                const int64_t* own_at) {
  const int64_t hkv = k_pages.size(0), bs = k_pages.size(2), d = k_pages.size(3);
  const int64_t s_head = k_pages.stride(0), s_block = k_pages.stride(1), s_row = k_pages.stride(2);
  const Src* kp = reinterpret_cast<const Src*>(k.data_ptr());
  const Src* vp = reinterpret_cast<const Src*>(v.data_ptr());
  Page* kd = reinterpret_cast<Page*>(k_pages.data_ptr());
  Page* vd = reinterpret_cast<Page*>(v_pages.data_ptr());
  const float ksc = static_cast<float>(k_scale), vsc = static_cast<float>(v_scale);
  for (int64_t t = 0; t < count; ++t) {
    const int64_t slot = slots[t];
    for (int64_t h = 0; h < hkv; ++h) {
      const Src* ks = kp + (t * hkv + h) * d;
      const Src* vs = vp + (t * hkv + h) * d;
      Page *kt, *vt;
      if (slot >= 0) {
        const int64_t off = h * s_head + (slot / bs) * s_block + (slot % bs) * s_row;
        kt = kd + off;
        vt = vd + off;
      } else if (own_at != nullptr && own_at[t] >= 0) {
        kt = own_k + (own_at[t] * hkv + h) * d;
        vt = own_v + (own_at[t] * hkv + h) * d;
      } else {
        continue;
      }
      if constexpr (std::is_same_v<Src, Page>) {
        std::memcpy(kt, ks, d * sizeof(Page));
        std::memcpy(vt, vs, d * sizeof(Page));
      } else {
        convert_row(ks, kt, d, ksc);
        convert_row(vs, vt, d, vsc);
      }
    }
  }
}

template <typename Src>
void store_pages(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pages, const at::Tensor& v_pages,
                 const int64_t* slots, int64_t count, double k_scale, double v_scale, void* own_k, void* own_v,
                 const int64_t* own_at) {
#define CHUNKATTN_STORE(PAGE)                                                                                    \
  return store_impl<Src, PAGE>(k, v, k_pages, v_pages, slots, count, k_scale, v_scale,                          \
                               reinterpret_cast<PAGE*>(own_k), reinterpret_cast<PAGE*>(own_v), own_at)
  switch (k_pages.scalar_type()) {
    case at::kFloat: CHUNKATTN_STORE(float);
    case at::kBFloat16: CHUNKATTN_STORE(c10::BFloat16);
    case at::kHalf: CHUNKATTN_STORE(c10::Half);
    case at::kFloat8_e4m3fn: CHUNKATTN_STORE(E4M3);
    case at::kFloat8_e5m2: CHUNKATTN_STORE(E5M2);
    default:
      TORCH_CHECK(false, "chunkattn native store: pages of dtype ", k_pages.scalar_type(), " are not served");
  }
#undef CHUNKATTN_STORE
}

inline void store_rows(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pages, const at::Tensor& v_pages,
                const int64_t* slots, int64_t count, double k_scale, double v_scale, void* own_k, void* own_v,
                const int64_t* own_at) {
  switch (k.scalar_type()) {
    case at::kFloat:
      return store_pages<float>(k, v, k_pages, v_pages, slots, count, k_scale, v_scale, own_k, own_v, own_at);
    case at::kBFloat16:
      return store_pages<c10::BFloat16>(k, v, k_pages, v_pages, slots, count, k_scale, v_scale, own_k, own_v, own_at);
    case at::kHalf:
      return store_pages<c10::Half>(k, v, k_pages, v_pages, slots, count, k_scale, v_scale, own_k, own_v, own_at);
    default:
      TORCH_CHECK(false, "chunkattn native store: k and v of dtype ", k.scalar_type(), " are not served");
  }
}

}  // namespace chunkattn

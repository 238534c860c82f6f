// plain_layers: every decoder layer of one decode step for up to 16 plain KV-cache rows, in one
// call: per layer, quant_matmul.cpp's pre_attention (RMSNorm, q|k|v, rotary), each row's new key
// and value written into its cache, decode_attention.cpp's split-key attention over the row's
// cache (every row's in one parallel region), and post_attention (o, residual, RMSNorm, gated MLP, residual). The same functions the
// lean step calls layer by layer from Python, without the ~20 small Python-side ops per layer
// that cost a 135M model's step about a quarter of its time (docs/decisions/072).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

// The two kernels' sources, each in its own namespace (their headers above are already in, so
// their includes add nothing inside it); LONGSERVE_NO_MODULE leaves out their Python modules.
#define LONGSERVE_NO_MODULE
namespace qm {
#include "quant_matmul.cpp"
}  // namespace qm
namespace da {
#include "decode_attention.cpp"
}  // namespace da

constexpr int64_t PER_LAYER = 14;  // w_in, q|k|v (3), w_post, o (3), gate|up (3), down (3)

// A row's new keys (or values) for every kv head, src (kv_heads, d) float32, stored at position
// p of dst (kv_heads, capacity, d) as the cache holds them
template <typename T>
void store_new(const float* src, T* dst, int64_t kv_heads, int64_t head_stride, int64_t p,
               int64_t d) {
  for (int64_t h = 0; h < kv_heads; ++h) {
    T* to = dst + h * head_stride + p * d;
    for (int64_t i = 0; i < d; ++i) to[i] = static_cast<T>(src[h * d + i]);
  }
}

// Layer l of a row's cache (layers, 2, kv_heads, capacity, d): its q|k|v row's new key and value
// stored at position p, and its attention over keys 0..p set up in job
template <typename T>
void new_token(const float* row, T* cache, int64_t l, int64_t p, int64_t heads, int64_t kv_heads,
               int64_t d, double scale, int64_t splits, int64_t capacity, da::DecodeJob& job) {
  const int64_t head_stride = capacity * d;
  T* keys = cache + l * 2 * kv_heads * head_stride;
  T* values = keys + kv_heads * head_stride;
  store_new(row + heads * d, keys, kv_heads, head_stride, p, d);
  store_new(row + (heads + kv_heads) * d, values, kv_heads, head_stride, p, d);
  job.set(row, keys, values, std::is_same<T, at::Half>::value, head_stride, head_stride, kv_heads,
          p + 1, d, heads / kv_heads, static_cast<float>(scale), splits);
}

// x (B, K) float32 rows of the residual stream; weights: PER_LAYER tensors per layer, as the
// lean step's pre_attention / post_attention take them; caches[b] row b's buffer (layers, 2,
// kv_heads, capacity, d), float32 or float16, its new token written at positions[b] (the keys
// before it are the row's context); cos, sin (B, d) at the rows' positions; splits[b] key
// chunks of row b's attention. -> (B, K) float32, the last layer's output.
torch::Tensor plain_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                           std::vector<torch::Tensor> caches, std::vector<int64_t> positions,
                           torch::Tensor cos, torch::Tensor sin, double eps, double scale,
                           int64_t heads, std::vector<int64_t> splits) {
  const int64_t rows = x.size(0);
  TORCH_CHECK(weights.size() % PER_LAYER == 0, "plain_layers: 14 tensors per layer");
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == rows &&
                  static_cast<int64_t>(positions.size()) == rows &&
                  static_cast<int64_t>(splits.size()) == rows,
              "plain_layers: a cache, a position and a split count per row");
  const int64_t layers = weights.size() / PER_LAYER;
  for (int64_t b = 0; b < rows; ++b) {
    const auto& c = caches[b];
    TORCH_CHECK(c.dim() == 5 && c.size(0) == layers && c.size(1) == 2 && c.is_contiguous() &&
                    positions[b] >= 0 && positions[b] < c.size(3),
                "plain_layers: cache (layers, 2, kv_heads, capacity, d) with room at position");
  }
  const int64_t kv_heads = caches[0].size(2), d = caches[0].size(4);
  TORCH_CHECK(heads % kv_heads == 0, "plain_layers: heads a multiple of kv_heads");
  for (const auto& c : caches) {
    TORCH_CHECK(c.size(2) == kv_heads && c.size(4) == d &&
                    (c.scalar_type() == at::kFloat || c.scalar_type() == at::kHalf),
                "plain_layers: every row's cache of the same heads, float32 or float16");
  }
  const int64_t width = (heads + 2 * kv_heads) * d;  // a row of q|k|v
  x = x.contiguous();
  std::vector<da::DecodeJob> jobs(rows);  // every row's attention, run in one parallel region
  auto attended = torch::empty({rows, heads * d}, x.options());
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + l * PER_LAYER;
    const auto qkv = qm::pre_attention(x, w[0], eps, w[1], w[2], w[3], cos, sin,
                                       (heads + kv_heads) * d);  // (B, (heads + 2 kv) * d)
    for (int64_t b = 0; b < rows; ++b) {
      const float* row = qkv.data_ptr<float>() + b * width;
      if (caches[b].scalar_type() == at::kHalf) {
        new_token(row, caches[b].data_ptr<at::Half>(), l, positions[b], heads, kv_heads, d, scale,
                  splits[b], caches[b].size(3), jobs[b]);
      } else {
        new_token(row, caches[b].data_ptr<float>(), l, positions[b], heads, kv_heads, d, scale,
                  splits[b], caches[b].size(3), jobs[b]);
      }
    }
    da::group_chunks(jobs);
    da::run_jobs(jobs);
    float* out = attended.data_ptr<float>();
    for (int64_t b = 0; b < rows; ++b) jobs[b].result_into(out + b * heads * d);
    x = qm::post_attention(x, attended, w[5], w[6], w[7], w[4], eps, w[8], w[9], w[10], w[11],
                           w[12], w[13]);
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("plain_layers", &plain_layers, "every decoder layer of plain KV rows' decode step (CPU)");
}

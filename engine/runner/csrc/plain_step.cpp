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
  const int64_t group = heads / kv_heads;
  x = x.contiguous();
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + l * PER_LAYER;
    const auto qkv = qm::pre_attention(x, w[0], eps, w[1], w[2], w[3], cos, sin,
                                       (heads + kv_heads) * d);  // (B, (heads + 2 kv) * d)
    std::vector<da::DecodeJob> jobs;  // every row's attention, run in one parallel region
    jobs.reserve(rows);
    for (int64_t b = 0; b < rows; ++b) {
      const auto row = qkv[b];
      const auto layer = caches[b][l];  // (2, kv_heads, capacity, d)
      const int64_t p = positions[b];
      layer.select(0, 0).select(1, p).copy_(row.narrow(0, heads * d, kv_heads * d).view({kv_heads, d}));
      layer.select(0, 1).select(1, p).copy_(
          row.narrow(0, (heads + kv_heads) * d, kv_heads * d).view({kv_heads, d}));
      const auto q = row.narrow(0, 0, heads * d).view({kv_heads, group, d});
      const auto keys = layer.select(0, 0).narrow(1, 0, p + 1);
      const auto values = layer.select(0, 1).narrow(1, 0, p + 1);
      jobs.emplace_back(q.contiguous(), keys, values, scale, splits[b]);
    }
    da::run_jobs(jobs);
    std::vector<torch::Tensor> attn;
    for (const auto& job : jobs) attn.push_back(job.result().view({1, heads * d}));
    const auto attended = rows == 1 ? attn[0] : torch::cat(attn);
    x = qm::post_attention(x, attended, w[5], w[6], w[7], w[4], eps, w[8], w[9], w[10], w[11],
                           w[12], w[13]);
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("plain_layers", &plain_layers, "every decoder layer of plain KV rows' decode step (CPU)");
}

// One decode token's attention over a KV cache on the CPU, split along the keys
// (flash-decoding): every (kv head, key chunk) task streams its keys and values once, with an
// online softmax for all the queries that share the kv head, and the partial results are merged
// by their log-sum-exp. torch's SDPA handles this shape (1-16 query rows) far below the memory
// bandwidth (docs/decisions/037-lean-decode-step.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;  // keys scored before their values are accumulated

// q (kv_heads, group, d) contiguous; k, v (kv_heads, S, d) with contiguous rows -> (kv_heads,
// group, d). All float32.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                               int64_t splits) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.is_contiguous(),
              "decode_attention: q (kv_heads, group, d) contiguous, k/v (kv_heads, S, d)");
  const int64_t heads = k.size(0), keys = k.size(1), d = k.size(2), group = q.size(1);
  TORCH_CHECK(q.size(0) == heads && q.size(2) == d && v.sizes() == k.sizes() && keys > 0,
              "decode_attention: shapes do not match");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == d && v.stride(1) == d,
              "decode_attention: k/v rows must be contiguous");
  splits = std::max<int64_t>(1, std::min(splits, keys));
  const int64_t chunk = (keys + splits - 1) / splits;
  auto acc = torch::zeros({heads, splits, group, d}, q.options());
  auto maxes = torch::full({heads, splits, group}, -FLT_MAX, q.options());
  auto sums = torch::zeros({heads, splits, group}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* ap = acc.data_ptr<float>();
  float* mp = maxes.data_ptr<float>();
  float* lp = sums.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, heads * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * kBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / splits, first = (task % splits) * chunk;
      const int64_t last = std::min(keys, first + chunk);
      const float* qh = qp + h * group * d;
      float* a = ap + task * group * d;
      float* m = mp + task * group;
      float* l = lp + task * group;
      for (int64_t b0 = first; b0 < last; b0 += kBlock) {
        const int64_t n = std::min(kBlock, last - b0);
        for (int64_t j = 0; j < n; ++j) {
          const float* kr = kp + h * ks + (b0 + j) * d;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qh + g * d;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; ++i) dot += qg[i] * kr[i];
            scores[g * kBlock + j] = dot * sc;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * kBlock;
          float top = m[g];
          for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j]);
          const float rescale = std::exp(m[g] - top);
          float total = l[g] * rescale;
#pragma omp simd reduction(+ : total)
          for (int64_t j = 0; j < n; ++j) {
            s[j] = std::exp(s[j] - top);  // vectorized (libmvec) under -ffast-math
            total += s[j];
          }
          m[g] = top;
          l[g] = total;
          float* ag = a + g * d;
          if (rescale != 1.f) {
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ag[i] *= rescale;
          }
        }
        for (int64_t j = 0; j < n; ++j) {
          const float* vr = vp + h * vs + (b0 + j) * d;
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * kBlock + j];
            float* ag = a + g * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ag[i] += p * vr[i];
          }
        }
      }
    }
  });

  auto out = torch::empty({heads, group, d}, q.options());
  float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t g = 0; g < group; ++g) {
      float top = -FLT_MAX;
      for (int64_t c = 0; c < splits; ++c) top = std::max(top, mp[(h * splits + c) * group + g]);
      float total = 0.f;
      float* o = op + (h * group + g) * d;
      std::fill(o, o + d, 0.f);
      for (int64_t c = 0; c < splits; ++c) {
        const int64_t idx = (h * splits + c) * group + g;
        const float w = std::exp(mp[idx] - top);
        total += lp[idx] * w;
        const float* a = ap + idx * d;
        for (int64_t i = 0; i < d; ++i) o[i] += w * a[i];
      }
      for (int64_t i = 0; i < d; ++i) o[i] /= total;
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one decode token's attention (float32, CPU)");
}

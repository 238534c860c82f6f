// decode_attention: one decode token's attention over a KV cache on the CPU, split along the keys
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

float dot(const float* a, const float* b, int64_t d) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < d; ++i) total += a[i] * b[i];
  return total;
}

// Fold one block of n keys into a running softmax: scores[g * kBlock + j] (scaled) for each of
// the group's queries, the running max m and sum l per query, the accumulator a (group, d), and
// the block's value rows at v, v + v_stride, ... (or, given at, at v + at[j] * v_stride)
void fold_block(float* scores, int64_t n, int64_t group, int64_t d, float* m, float* l, float* a,
                const float* v, int64_t v_stride, const int64_t* at = nullptr) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * kBlock;
    float top = m[g];
    for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j]);
    if (top == -FLT_MAX) {  // every key so far left out (attend_pieces' masks): nothing to add
      std::fill(s, s + n, 0.f);
      continue;
    }
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
    const float* vr = v + (at ? at[j] : j) * v_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * kBlock + j];
      float* ag = a + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) ag[i] += p * vr[i];
    }
  }
}

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
          for (int64_t g = 0; g < group; ++g) scores[g * kBlock + j] = dot(qh + g * d, kr, d) * sc;
        }
        fold_block(scores.data(), n, group, d, m, l, a, vp + h * vs + b0 * d, d);
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

// One decode token over several pieces of keys under one softmax (a memory frame's step:
// engine/memory/step_cache.py): queries[i] (kv_heads, nq, group, d) contiguous, keys[i] and
// values[i] (kv_heads, n, d) with contiguous rows, key j of piece i scored by its query
// j / (n / nq) (nq > 1: one query per block of keys); masks[i] (kv_heads, n) bool, or empty
// for none (a False key is left out). -> (kv_heads, group, d). All float32.
torch::Tensor attend_pieces(std::vector<torch::Tensor> queries, std::vector<torch::Tensor> keys,
                            std::vector<torch::Tensor> values, std::vector<torch::Tensor> masks,
                            std::vector<torch::Tensor> rows, double scale) {
  const size_t pieces = queries.size();
  TORCH_CHECK(pieces > 0 && keys.size() == pieces && values.size() == pieces &&
                  masks.size() == pieces && rows.size() == pieces,
              "attend_pieces: as many queries, keys, values, masks and rows");
  const int64_t heads = queries[0].size(0), group = queries[0].size(2), d = queries[0].size(3);
  std::vector<int64_t> lengths(pieces);
  for (size_t i = 0; i < pieces; ++i) {
    const auto &q = queries[i], &k = keys[i], &v = values[i], &mask = masks[i], &row = rows[i];
    TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                    v.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4,
                "attend_pieces: float32, queries (kv_heads, nq, group, d) contiguous");
    TORCH_CHECK(row.numel() == 0 || (row.scalar_type() == at::kLong && row.is_contiguous() &&
                                     row.dim() == 2 && row.size(0) == heads),
                "attend_pieces: rows (kv_heads, n) int64");
    if (row.numel()) {  // the keys are read in place: every row index within k
      const int64_t* r = row.data_ptr<int64_t>();
      bool inside = true;
      for (int64_t j = 0; j < row.numel(); ++j) inside &= r[j] >= 0 && r[j] < k.size(1);
      TORCH_CHECK(inside, "attend_pieces: a row index outside the keys");
    }
    lengths[i] = row.numel() ? row.size(1) : k.size(1);
    TORCH_CHECK(q.size(0) == heads && q.size(2) == group && q.size(3) == d && k.dim() == 3 &&
                    k.size(0) == heads && k.size(2) == d && v.sizes() == k.sizes() &&
                    lengths[i] % q.size(1) == 0,
                "attend_pieces: shapes do not match");
    TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "attend_pieces: k/v rows contiguous");
    TORCH_CHECK(mask.numel() == 0 || (mask.scalar_type() == at::kBool && mask.is_contiguous() &&
                                      mask.size(0) == heads && mask.size(1) == lengths[i]),
                "attend_pieces: masks (kv_heads, n) bool");
  }
  auto out = torch::empty({heads, group, d}, queries[0].options());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * kBlock), m(group), l(group), a(group * d);
    for (int64_t h = begin; h < end; ++h) {
      std::fill(m.begin(), m.end(), -FLT_MAX);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(a.begin(), a.end(), 0.f);
      for (size_t i = 0; i < pieces; ++i) {
        const auto &q = queries[i], &k = keys[i], &v = values[i], &mask = masks[i];
        const int64_t n = lengths[i], nq = q.size(1), per = n / nq;
        const float* qp = q.data_ptr<float>() + h * nq * group * d;
        const float* kp = k.data_ptr<float>() + h * k.stride(0);
        const float* vp = v.data_ptr<float>() + h * v.stride(0);
        const bool* ok = mask.numel() ? mask.data_ptr<bool>() + h * n : nullptr;
        const int64_t* at = rows[i].numel() ? rows[i].data_ptr<int64_t>() + h * n : nullptr;
        for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
          const int64_t count = std::min(kBlock, n - b0);
          for (int64_t j = 0; j < count; ++j) {
            const float* kr = kp + (at ? at[b0 + j] : b0 + j) * k.stride(1);
            const float* qj = qp + ((b0 + j) / per) * group * d;
            for (int64_t g = 0; g < group; ++g) {
              scores[g * kBlock + j] =
                  (ok && !ok[b0 + j]) ? -FLT_MAX : dot(qj + g * d, kr, d) * sc;
            }
          }
          fold_block(scores.data(), count, group, d, m.data(), l.data(), a.data(),
                     at ? vp : vp + b0 * v.stride(1), v.stride(1), at ? at + b0 : nullptr);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + (h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) o[i] = a[g * d + i] / l[g];
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one decode token's attention (float32, CPU)");
  m.def("attend_pieces", &attend_pieces, "one decode token over pieces of keys (float32, CPU)");
}

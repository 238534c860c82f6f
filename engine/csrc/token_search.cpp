// token_search: tokens' top-k search over one layer's memory keys, in one call for all its KV
// heads and query rows (engine/memory/key_sketch.py holds what it reads; tokens.py's torch
// path computes the same exactly).
//
// Each query row first scores every key on only `dims` of the 64 dimensions: those where
// |q_i| * rms_i (the keys' root mean square in dimension i) is largest, read from a copy of the
// pre-rotary keys held dimension-major in float16 (a dimension of all keys is one contiguous
// run). The `candidates` best of those partial scores are then scored exactly on the frame's
// own memory keys, and the best k of them kept (SparQ attention's two steps, for retrieval).
// With dims >= d or candidates >= n every key is scored exactly.
//
// The frame's memory keys (float16 or float32) are stored rotated by their offset in their
// block when `block_local`: a key at offset o is then scored with the query rotated by o
// (R(o) q . R(o) k = q . k), from the frame's rotary table (cos and sin rows with the sign of
// rotate_half folded into sin's first half).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include <algorithm>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kMaxDim = 512;

// a row as floats: in place for float32, widened into buf for float16
const float* as_floats(const float* x, int64_t, float*) { return x; }
const float* as_floats(const at::Half* x, int64_t d, float* buf) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= d; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < d; ++i) buf[i] = static_cast<float>(x[i]);
  return buf;
}

// acc[0..n) += w * x[0..n), x float16
void add_scaled(float* acc, const at::Half* x, float w, int64_t n) {
  int64_t j = 0;
#ifdef __F16C__
  const __m256 wv = _mm256_set1_ps(w);
  for (; j + 8 <= n; j += 8) {
    const __m256 xv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j)));
    _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(wv, xv, _mm256_loadu_ps(acc + j)));
  }
#endif
  for (; j < n; ++j) acc[j] += w * static_cast<float>(x[j]);
}

float dot(const float* a, const float* b, int64_t d) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < d; ++i) total += a[i] * b[i];
  return total;
}

using Hit = std::pair<float, int64_t>;  // (score, memory row)

// better first: the higher score, on ties the lower row (a stable order for the tests)
bool better(const Hit& a, const Hit& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// The rows of about the `want` best partial scores of a row, never fewer than `least`: the
// threshold is a rank in a strided sample, so no selection over all n keys is needed.
std::vector<int64_t> best_partial(const std::vector<float>& partial, int64_t want, int64_t least) {
  const int64_t n = static_cast<int64_t>(partial.size());
  const int64_t stride = std::max<int64_t>(1, std::min<int64_t>(16, want / 64));
  std::vector<float> sample;
  sample.reserve(n / stride + 1);
  for (int64_t j = 0; j < n; j += stride) sample.push_back(partial[j]);
  const int64_t size = static_cast<int64_t>(sample.size());
  const int64_t nth = std::min<int64_t>(std::max(want, least + least / 2) / stride, size) - 1;
  std::nth_element(sample.begin(), sample.begin() + nth, sample.end(), std::greater<float>());
  float threshold = sample[nth];
  std::vector<int64_t> rows;
  rows.reserve(want + want / 2);
  for (int64_t j = 0; j < n; ++j) {
    if (partial[j] >= threshold) rows.push_back(j);
  }
  if (static_cast<int64_t>(rows.size()) < least) {  // the sample was far off: select exactly
    std::vector<float> all(partial);
    std::nth_element(all.begin(), all.begin() + least - 1, all.end(), std::greater<float>());
    threshold = all[least - 1];
    rows.clear();
    for (int64_t j = 0; j < n; ++j) {
      if (partial[j] >= threshold) rows.push_back(j);
    }
  }
  return rows;
}

// One query row's top k (best first) over one KV head.
template <typename T>
std::vector<Hit> search_row(const float* q, const float* q_offsets, bool block_local,
                            const T* keys, int64_t key_stride, const at::Half* sketch,
                            int64_t sketch_stride, const float* rms, int64_t n, int64_t d,
                            int64_t block, int64_t k, int64_t dims, int64_t candidates) {
  std::vector<int64_t> rows;
  if (dims < d && candidates < n) {
    std::vector<int64_t> order(d);
    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + dims, order.end(), [&](int64_t a, int64_t b) {
      return std::abs(q[a]) * rms[a] > std::abs(q[b]) * rms[b];
    });
    std::vector<float> partial(n, 0.f);
    for (int64_t i = 0; i < dims; ++i) {
      add_scaled(partial.data(), sketch + order[i] * sketch_stride, q[order[i]], n);
    }
    rows = best_partial(partial, candidates, std::min(k, n));
  } else {
    rows.resize(n);
    std::iota(rows.begin(), rows.end(), int64_t{0});
  }
  float kbuf[kMaxDim];
  std::vector<Hit> hits(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) {
    const int64_t row = rows[j];
    const float* key = as_floats(keys + row * key_stride, d, kbuf);
    hits[j] = {dot(block_local ? q_offsets + (row % block) * d : q, key, d), row};
  }
  const int64_t top = std::min<int64_t>(k, static_cast<int64_t>(hits.size()));
  std::partial_sort(hits.begin(), hits.begin() + top, hits.end(), better);
  hits.resize(top);
  return hits;
}

// queries (kv_heads, R, d) float32 contiguous, each head's rows in rank order (tokens.py's
// fair_union: the last token's rows first); keys (kv_heads, n, d) float32 or float16 with
// contiguous rows (the frame's memory keys); sketch (kv_heads, d, n) float16, the pre-rotary
// keys dimension-major with contiguous runs; rms (kv_heads, d) float32; cos and sin the rotary
// table (at least `block` rows) when block_local.
// -> rows (kv_heads, width) int64: each head's first k distinct hits taken rank by rank over
// its query rows, ascending, -1 padded.
torch::Tensor search(torch::Tensor queries, torch::Tensor keys, torch::Tensor sketch,
                     torch::Tensor rms, torch::Tensor cos, torch::Tensor sin, bool block_local,
                     int64_t k, int64_t block, int64_t dims, int64_t candidates) {
  const auto held = keys.scalar_type();
  TORCH_CHECK(queries.scalar_type() == at::kFloat && queries.is_contiguous() &&
                  queries.dim() == 3 && keys.dim() == 3 && keys.size(0) == queries.size(0) &&
                  keys.size(2) == queries.size(2) && keys.stride(2) == 1 &&
                  (held == at::kFloat || held == at::kHalf) && queries.size(2) <= kMaxDim,
              "token_search: queries (kv_heads, R, d) float32 contiguous, keys (kv_heads, n, d)");
  const int64_t kvh = queries.size(0), R = queries.size(1), d = queries.size(2);
  const int64_t n = keys.size(1);
  TORCH_CHECK(sketch.scalar_type() == at::kHalf && sketch.dim() == 3 && sketch.size(0) == kvh &&
                  sketch.size(1) == d && sketch.size(2) == n && sketch.stride(2) == 1 &&
                  rms.scalar_type() == at::kFloat && rms.is_contiguous() &&
                  rms.sizes() == sketch.sizes().slice(0, 2),
              "token_search: sketch (kv_heads, d, n) float16 and rms (kv_heads, d) float32");
  TORCH_CHECK(k > 0 && block > 0 && dims > 0 && candidates >= k,
              "token_search: k, block and dims > 0, candidates >= k");
  if (block_local) {
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                    cos.sizes() == sin.sizes() && cos.size(1) == d && cos.size(0) >= block &&
                    d % 2 == 0,
                "token_search: rotary table cos/sin (positions >= block, d) float32");
  }
  std::vector<std::vector<Hit>> rows(kvh * R);
  const float* qp = queries.data_ptr<float>();
  at::parallel_for(0, kvh * R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(block_local ? block * d : 0);
    for (int64_t at = begin; at < end; ++at) {
      const int64_t h = at / R;
      const float* q = qp + at * d;
      if (block_local) {
        const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
        const int64_t half = d / 2;
        for (int64_t o = 0; o < block; ++o) {
          for (int64_t i = 0; i < d; ++i) {
            const float swapped = i < half ? q[i + half] : q[i - half];
            rotated[o * d + i] = q[i] * c[o * d + i] + swapped * s[o * d + i];
          }
        }
      }
      const at::Half* sk = sketch.data_ptr<at::Half>() + h * sketch.stride(0);
      const float* rh = rms.data_ptr<float>() + h * d;
      if (held == at::kHalf) {
        rows[at] = search_row(q, rotated.data(), block_local,
                              keys.data_ptr<at::Half>() + h * keys.stride(0), keys.stride(1), sk,
                              sketch.stride(1), rh, n, d, block, k, dims, candidates);
      } else {
        rows[at] = search_row(q, rotated.data(), block_local,
                              keys.data_ptr<float>() + h * keys.stride(0), keys.stride(1), sk,
                              sketch.stride(1), rh, n, d, block, k, dims, candidates);
      }
    }
  });
  // each head's first k distinct rows rank by rank over its query rows, then ascending
  std::vector<std::vector<int64_t>> picked(kvh);
  std::vector<char> seen(n);
  int64_t width = 0;
  for (int64_t h = 0; h < kvh; ++h) {
    std::fill(seen.begin(), seen.end(), 0);
    auto& ids = picked[h];
    for (int64_t rank = 0; rank < k && static_cast<int64_t>(ids.size()) < k; ++rank) {
      for (int64_t r = 0; r < R && static_cast<int64_t>(ids.size()) < k; ++r) {
        const auto& hits = rows[h * R + r];
        if (rank >= static_cast<int64_t>(hits.size())) continue;
        const int64_t row = hits[rank].second;
        if (!seen[row]) {
          seen[row] = 1;
          ids.push_back(row);
        }
      }
    }
    std::sort(ids.begin(), ids.end());
    width = std::max(width, static_cast<int64_t>(ids.size()));
  }
  auto out = torch::full({kvh, width}, -1, queries.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t h = 0; h < kvh; ++h) std::copy(picked[h].begin(), picked[h].end(), op + h * width);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("search", &search, "tokens' top-k memory rows of one layer, sketch then exact (CPU)");
}

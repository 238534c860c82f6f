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
// threshold is a rank in a strided sample of about 2048 scores, so no selection over all n.
std::vector<int64_t> best_partial(const float* partial, int64_t n, int64_t want, int64_t least) {
  const int64_t stride = std::max<int64_t>(1, n / 2048);
  std::vector<float> sample;
  sample.reserve(n / stride + 1);
  for (int64_t j = 0; j < n; j += stride) sample.push_back(partial[j]);
  const int64_t size = static_cast<int64_t>(sample.size());
  const int64_t nth = std::min<int64_t>(std::max(want, least + least / 2) / stride, size) - 1;
  std::nth_element(sample.begin(), sample.begin() + std::max<int64_t>(nth, 0), sample.end(),
                   std::greater<float>());
  float threshold = sample[std::max<int64_t>(nth, 0)];
  std::vector<int64_t> rows;
  rows.reserve(want + want / 2);
  for (int64_t j = 0; j < n; ++j) {
    if (partial[j] >= threshold) rows.push_back(j);
  }
  if (static_cast<int64_t>(rows.size()) < least) {  // the sample was far off: select exactly
    std::vector<float> all(partial, partial + n);
    std::nth_element(all.begin(), all.begin() + least - 1, all.end(), std::greater<float>());
    threshold = all[least - 1];
    rows.clear();
    for (int64_t j = 0; j < n; ++j) {
      if (partial[j] >= threshold) rows.push_back(j);
    }
  }
  return rows;
}

// Each dimension's weights: which of a head's R rows score on it, with their q_i (the `dims`
// largest |q_i| * rms_i of each row).
std::vector<std::vector<std::pair<int64_t, float>>> row_dims(const float* q, int64_t R, int64_t d,
                                                             const float* rms, int64_t dims) {
  std::vector<std::vector<std::pair<int64_t, float>>> users(d);
  std::vector<int64_t> order(d);
  for (int64_t r = 0; r < R; ++r) {
    const float* qr = q + r * d;
    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + dims, order.end(), [&](int64_t a, int64_t b) {
      return std::abs(qr[a]) * rms[a] > std::abs(qr[b]) * rms[b];
    });
    for (int64_t i = 0; i < dims; ++i) users[order[i]].push_back({r, qr[order[i]]});
  }
  return users;
}

// partial (R, n) += over keys [begin, end) of one head: each row's q_i times dimension i of the
// sketch, for its dimensions; each dimension's run is widened once, in tiles, for all its rows.
void partial_scores(const std::vector<std::vector<std::pair<int64_t, float>>>& users,
                    const at::Half* sketch, int64_t sketch_stride, int64_t n, int64_t begin,
                    int64_t end, float* partial) {
  constexpr int64_t kTile = 512;
  float buf[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t len = std::min(kTile, end - t);
    for (size_t i = 0; i < users.size(); ++i) {
      if (users[i].empty()) continue;
      as_floats(sketch + i * sketch_stride + t, len, buf);
      for (const auto& [r, w] : users[i]) {
        float* acc = partial + r * n + t;
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) acc[j] += w * buf[j];
      }
    }
  }
}

// One query row's top k (best first) over one KV head: its candidate rows scored exactly.
template <typename T>
std::vector<Hit> exact_top(const float* q, const float* q_offsets, bool block_local, const T* keys,
                           int64_t key_stride, const std::vector<int64_t>& rows, int64_t d,
                           int64_t block, int64_t k) {
  float kbuf[kMaxDim];
  std::vector<Hit> hits(rows.size());
  constexpr size_t kAhead = 8;  // candidates are scattered: fetch their rows ahead of use
  for (size_t j = 0; j < rows.size(); ++j) {
    if (j + kAhead < rows.size()) {
      const char* next = reinterpret_cast<const char*>(keys + rows[j + kAhead] * key_stride);
      for (size_t b = 0; b < d * sizeof(T); b += 64) __builtin_prefetch(next + b);
    }
    const int64_t row = rows[j];
    const float* key = as_floats(keys + row * key_stride, d, kbuf);
    hits[j] = {dot(block_local ? q_offsets + (row % block) * d : q, key, d), row};
  }
  const int64_t top = std::min<int64_t>(k, static_cast<int64_t>(hits.size()));
  std::nth_element(hits.begin(), hits.begin() + top - 1, hits.end(), better);
  hits.resize(top);
  std::sort(hits.begin(), hits.end(), better);
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
  const float* qp = queries.data_ptr<float>();
  const bool sketched = dims < d && candidates < n;
  // 1. partial scores (kv_heads, R, n), split over heads and runs of keys
  std::vector<float> partial(sketched ? kvh * R * n : 0, 0.f);
  if (sketched) {
    std::vector<std::vector<std::vector<std::pair<int64_t, float>>>> users(kvh);
    for (int64_t h = 0; h < kvh; ++h) {
      users[h] = row_dims(qp + h * R * d, R, d, rms.data_ptr<float>() + h * d, dims);
    }
    constexpr int64_t kRun = 4096;
    const int64_t runs = (n + kRun - 1) / kRun;
    at::parallel_for(0, kvh * runs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t at = begin; at < end; ++at) {
        const int64_t h = at / runs, first = (at % runs) * kRun;
        partial_scores(users[h], sketch.data_ptr<at::Half>() + h * sketch.stride(0),
                       sketch.stride(1), n, first, std::min(n, first + kRun),
                       partial.data() + h * R * n);
      }
    });
  }
  // 2. each row's candidates scored exactly, its top k kept
  std::vector<std::vector<Hit>> rows(kvh * R);
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
      std::vector<int64_t> picked;
      if (sketched) {
        picked = best_partial(partial.data() + at * n, n, candidates, std::min(k, n));
      } else {
        picked.resize(n);
        std::iota(picked.begin(), picked.end(), int64_t{0});
      }
      if (held == at::kHalf) {
        rows[at] = exact_top(q, rotated.data(), block_local,
                             keys.data_ptr<at::Half>() + h * keys.stride(0), keys.stride(1),
                             picked, d, block, k);
      } else {
        rows[at] = exact_top(q, rotated.data(), block_local,
                             keys.data_ptr<float>() + h * keys.stride(0), keys.stride(1), picked,
                             d, block, k);
      }
    }
  });
  // 3. each head's first k distinct rows rank by rank over its query rows, then ascending
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

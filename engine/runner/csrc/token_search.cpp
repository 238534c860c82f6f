// token_search: tokens' top-k search over one layer's memory keys, in one call for all its KV
// heads and query rows (engine/memory/key_sketch.py holds what it reads; its torch path computes
// the same).
//
// It reads a copy of the layer's pre-rotary keys held dimension-major in float16 (a dimension
// of all keys is one contiguous run), the "sketch", and scores every key exactly on all its
// dimensions: 64 keys by up to 4 query rows at a time in registers, the next tile's runs
// fetched ahead (the hardware prefetcher does not follow 64 strided runs). Each row's best k
// then sit above a bar read off a sample of its scores (docs/decisions/051-tokens-exact-scan.md).
// The frame stores its memory keys rotated by their offset in their block; that rotation
// cancels in the score (R(o)q . R(o)k = q . k), so the pre-rotary keys score the same.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace {

constexpr int64_t kTile = 256;  // keys whose runs are fetched ahead together
constexpr int64_t kRun = 4096;  // keys per parallel task, at most

// out (d) = q rotated by one rotary table row: q * cos + swap_halves(q) * sin
void rotate(const float* q, const float* c, const float* s, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    out[i] = q[i] * c[i] + (i < half ? q[i + half] : q[i - half]) * s[i];
  }
}

#ifdef __AVX512F__
// scores of 64 keys from `at` for RN rows from r0, held in registers over all d dimensions;
// w (d, R) the rows' queries, dimension-major
template <int RN>
void block_scores(const float* w, const at::Half* sketch, int64_t sketch_stride, int64_t d,
                  int64_t at, int64_t R, int64_t r0, float* out, int64_t out_stride) {
  __m512 acc[RN][4];
  for (int r = 0; r < RN; ++r) {
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  w += r0;
  for (int64_t i = 0; i < d; ++i, w += R) {
    const at::Half* run = sketch + i * sketch_stride + at;
    __m512 key[4];
    for (int v = 0; v < 4; ++v) {
      key[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 16 * v)));
    }
    for (int r = 0; r < RN; ++r) {
      const __m512 wr = _mm512_set1_ps(w[r]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(wr, key[v], acc[r][v]);
    }
  }
  for (int r = 0; r < RN; ++r) {
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + (r0 + r) * out_stride + 16 * v, acc[r][v]);
  }
}
#endif

// Every key's exact score for all R rows of one head, keys [first, last): scores (R, n) with row
// stride n; w (d, R) the rows' queries, dimension-major.
void scan_scores(const float* w, const at::Half* sketch, int64_t sketch_stride, int64_t d,
                 int64_t first, int64_t last, int64_t R, int64_t n, float* scores) {
  int64_t j = first;
#ifdef __AVX512F__
  for (; j + 64 <= last; j += 64) {
    if ((j - first) % kTile == 0) {  // the next tile's runs, fetched while this one is scored
      for (int64_t i = 0; i < d; ++i) {
        const char* next = reinterpret_cast<const char*>(sketch + i * sketch_stride + j + kTile);
        for (int64_t b = 0; b < kTile * 2; b += 64) __builtin_prefetch(next + b);
      }
    }
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      switch (std::min<int64_t>(4, R - r0)) {
        case 1: block_scores<1>(w, sketch, sketch_stride, d, j, R, r0, scores + j, n); break;
        case 2: block_scores<2>(w, sketch, sketch_stride, d, j, R, r0, scores + j, n); break;
        case 3: block_scores<3>(w, sketch, sketch_stride, d, j, R, r0, scores + j, n); break;
        default: block_scores<4>(w, sketch, sketch_stride, d, j, R, r0, scores + j, n);
      }
    }
  }
#endif
  for (; j < last; ++j) {
    for (int64_t r = 0; r < R; ++r) scores[r * n + j] = 0.f;
    for (int64_t i = 0; i < d; ++i) {
      const float k = static_cast<float>(sketch[i * sketch_stride + j]);
      for (int64_t r = 0; r < R; ++r) scores[r * n + j] += w[i * R + r] * k;
    }
  }
}

// A hit packed so that ascending order is best first: the score's bits, mapped to an unsigned
// order and inverted, above the memory row. Ties go to the lower row, as in the torch path's
// stable sort (key_sketch.search_torch).
inline uint64_t packed_hit(float score, int64_t row) {
  uint32_t u;
  std::memcpy(&u, &score, sizeof u);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending as the floats are
  return (static_cast<uint64_t>(~u) << 32) | static_cast<uint32_t>(row);
}

// Stable LSD radix sort of packed hits by their upper 32 bits (the score): rows stay ascending
// among equal scores, as they were collected. Bytes every hit shares are skipped.
void sort_hits(std::vector<uint64_t>& hits) {
  std::vector<uint64_t> other(hits.size());
  for (int shift = 32; shift < 64; shift += 8) {
    int64_t count[257] = {0};
    for (const uint64_t h : hits) ++count[((h >> shift) & 0xff) + 1];
    if (count[((hits[0] >> shift) & 0xff) + 1] == static_cast<int64_t>(hits.size())) continue;
    for (int b = 0; b < 256; ++b) count[b + 1] += count[b];
    for (const uint64_t h : hits) other[count[(h >> shift) & 0xff]++] = h;
    hits.swap(other);
  }
}

// The keys of scores (n) at or above bar, packed, in ascending row order.
void collect_at_least(const float* s, int64_t n, float bar, std::vector<uint64_t>& hits) {
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 b = _mm512_set1_ps(bar);
  for (; j + 16 <= n; j += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + j), b, _CMP_GE_OQ);
    while (m) {
      const int bit = __builtin_ctz(m);
      hits.push_back(packed_hit(s[j + bit], j + bit));
      m &= m - 1;
    }
  }
#endif
  for (; j < n; ++j) {
    if (s[j] >= bar) hits.push_back(packed_hit(s[j], j));
  }
}

// A bar with about `rank` + 1 of the m values at or above it: the lower edge of the bin holding
// the rank-th largest in a 256-bin histogram between their minimum and maximum.
float histogram_bar(const float* v, int64_t m, int64_t rank) {
  float lo = v[0], hi = v[0];
  for (int64_t j = 1; j < m; ++j) {
    lo = std::min(lo, v[j]);
    hi = std::max(hi, v[j]);
  }
  if (!(hi > lo)) return lo;
  constexpr int kBins = 256;
  const float scale = kBins / (hi - lo);
  int64_t count[kBins] = {0};
  for (int64_t j = 0; j < m; ++j) {
    const float x = (v[j] - lo) * scale;  // NaN (from non-finite scores) counts in bin 0
    ++count[x >= 0.f ? std::min<int64_t>(kBins - 1, static_cast<int64_t>(x)) : 0];
  }
  int64_t above = 0;
  int bin = kBins - 1;
  for (; bin > 0; --bin) {
    above += count[bin];
    if (above > rank) break;
  }
  return lo + bin / scale;
}

// A row's best k of n scores as memory rows, best first. A bar is read off a histogram of about
// 1,024 evenly spaced scores at the rank of about 1.5k hits; the hits at or above it are sorted
// and cut to k. With fewer than k at the bar, or n under 4k, every score is a hit.
std::vector<int64_t> top_of_scores(const float* s, int64_t n, int64_t k) {
  const int64_t top = std::min(k, n);
  if (top == 0) return {};
  std::vector<uint64_t> hits;
  if (n >= 4 * top) {
    const int64_t stride = std::max<int64_t>(1, n / 1024);
    std::vector<float> sample;
    sample.reserve(n / stride + 1);
    for (int64_t j = 0; j < n; j += stride) sample.push_back(s[j]);
    const int64_t rank = (3 * top / 2) / stride;
    hits.reserve(2 * top);
    collect_at_least(s, n, histogram_bar(sample.data(), sample.size(), rank), hits);
  }
  if (static_cast<int64_t>(hits.size()) < top) {
    hits.clear();
    collect_at_least(s, n, -std::numeric_limits<float>::infinity(), hits);
  }
  if (hits.empty()) return {};  // every score NaN
  sort_hits(hits);
  std::vector<int64_t> rows(std::min<int64_t>(top, hits.size()));
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<uint32_t>(hits[i]);
  return rows;
}

// queries (kv_heads, R, d) float32 contiguous, each head's rows in rank order (tokens.py's
// fair_union: the last token's rows first); sketch (kv_heads, d, n) float16, the pre-rotary
// keys dimension-major with contiguous runs; cos and sin the rotary table; position >= 0
// rotates the queries by that table row first (-1: as given).
// -> rows (kv_heads, width) int64: each head's first k distinct hits taken rank by rank over
// its query rows, ascending, -1 padded.
torch::Tensor search(torch::Tensor queries, torch::Tensor sketch, torch::Tensor cos,
                     torch::Tensor sin, int64_t k, int64_t position) {
  TORCH_CHECK(queries.scalar_type() == at::kFloat && queries.is_contiguous() &&
                  queries.dim() == 3,
              "token_search: queries (kv_heads, R, d) float32 contiguous");
  const int64_t kvh = queries.size(0), R = queries.size(1), d = queries.size(2);
  TORCH_CHECK(sketch.scalar_type() == at::kHalf && sketch.dim() == 3 && sketch.size(0) == kvh &&
                  sketch.size(1) == d && sketch.stride(2) == 1,
              "token_search: sketch (kv_heads, d, n) float16 with contiguous runs");
  TORCH_CHECK(k > 0, "token_search: k > 0");
  const int64_t n = sketch.size(2);
  if (position >= 0) {
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                    cos.sizes() == sin.sizes() && cos.size(1) == d && position < cos.size(0) &&
                    d % 2 == 0,
                "token_search: rotary table cos/sin (positions > position, d) float32");
  }
  const float* qp = queries.data_ptr<float>();
  std::vector<float> q(qp, qp + kvh * R * d);  // rotated by `position` first, when given
  if (position >= 0) {
    const float *c = cos.data_ptr<float>() + position * d, *s = sin.data_ptr<float>() + position * d;
    for (int64_t row = 0; row < kvh * R; ++row) rotate(qp + row * d, c, s, d, &q[row * d]);
  }
  // each head's queries dimension-major: w (kv_heads, d, R)
  std::vector<float> w(kvh * d * R);
  for (int64_t h = 0; h < kvh; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t i = 0; i < d; ++i) w[(h * d + i) * R + r] = q[(h * R + r) * d + i];
    }
  }
  const at::Half* sp = sketch.data_ptr<at::Half>();
  std::unique_ptr<float[]> scores(new float[kvh * R * n]);
  // runs of whole tiles, at least 4 a head so that small memories still split evenly
  const int64_t run = std::clamp<int64_t>((n / 4 + kTile - 1) / kTile * kTile, kTile, kRun);
  const int64_t runs = (n + run - 1) / run;
  at::parallel_for(0, kvh * runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t at = begin; at < end; ++at) {
      const int64_t h = at / runs, first = (at % runs) * run;
      scan_scores(w.data() + h * d * R, sp + h * sketch.stride(0), sketch.stride(1), d, first,
                  std::min(n, first + run), R, n, scores.get() + h * R * n);
    }
  });
  std::vector<std::vector<int64_t>> hits(kvh * R);
  at::parallel_for(0, kvh * R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t at = begin; at < end; ++at) hits[at] = top_of_scores(scores.get() + at * n, n, k);
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
        const auto& row_hits = hits[h * R + r];
        if (rank >= static_cast<int64_t>(row_hits.size())) continue;
        const int64_t row = row_hits[rank];
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
  m.def("search", &search, "tokens' top-k memory rows of one layer from the key sketch (CPU)");
}

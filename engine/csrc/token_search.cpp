// token_search: tokens' top-k search over one layer's memory keys, in one call for all its KV
// heads and query rows (engine/memory/key_sketch.py holds what it reads; its torch path computes
// the same).
//
// What it reads: a copy of the pre-rotary keys held dimension-major in float16 (a dimension of
// all keys is one contiguous run), the "sketch". Two searches:
// - exact (the default, decision 051): every key scored on all its dimensions straight from the
//   sketch, 64 keys by up to 4 rows at a time in registers, the next tile's runs fetched ahead;
//   each row's best k then sit above a bar read off a sample of its scores.
// - candidates (dims < d and candidates < n / 2): each row scores every key on only `dims`
//   dimensions, those where |q_i| * rms_i (the keys' root mean square in dimension i) is
//   largest. A key whose partial score reaches any of its head's rows' thresholds (each about
//   the `candidates`-th best of that row's, read off a sample) is scored exactly for every row
//   of the head on the frame's own memory keys (SparQ attention's two steps, for retrieval).
//
// The frame's memory keys (float16 or float32) are stored rotated by their offset in their
// block when `block_local`: a key at offset o is then scored with the query rotated by o
// (R(o) q . R(o) k = q . k), from the frame's rotary table (cos and sin rows with the sign of
// rotate_half folded into sin's first half). The sketch's keys are pre-rotary: no rotation.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include <algorithm>
#include <memory>
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
#ifdef __AVX512F__
  if (d % 32 == 0) {  // two chains of fused multiply-adds, one reduction (omp simd spills)
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {
      even = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), even);
      odd = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), odd);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
  }
#endif
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < d; ++i) total += a[i] * b[i];
  return total;
}

// out (d) = q rotated by one rotary table row: q * cos + swap_halves(q) * sin
void rotate(const float* q, const float* c, const float* s, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    out[i] = q[i] * c[i] + (i < half ? q[i + half] : q[i - half]) * s[i];
  }
}

using Hit = std::pair<float, int64_t>;  // (score, memory row)

// better first: the higher score, on ties the lower row (a stable order for the tests); a
// function object, so that std::sort inlines it
struct Better {
  bool operator()(const Hit& a, const Hit& b) const {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  }
};
constexpr Better better{};

// The dimensions any of a head's R rows scores on (each row's `dims` largest |q_i| * rms_i), and
// every row's weight on each of them: its q_i, or 0 where the dimension is not one of its own.
struct Users {
  std::vector<int64_t> used;
  std::vector<float> weight;  // (used.size(), R)
};
Users row_dims(const float* q, int64_t R, int64_t d, const float* rms, int64_t dims) {
  std::vector<float> dense(d * R, 0.f);
  std::vector<char> chosen(d, 0);
  std::vector<int64_t> order(d);
  for (int64_t r = 0; r < R; ++r) {
    const float* qr = q + r * d;
    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + dims, order.end(), [&](int64_t a, int64_t b) {
      return std::abs(qr[a]) * rms[a] > std::abs(qr[b]) * rms[b];
    });
    for (int64_t i = 0; i < dims; ++i) {
      dense[order[i] * R + r] = qr[order[i]];
      chosen[order[i]] = 1;
    }
  }
  Users users;
  for (int64_t i = 0; i < d; ++i) {
    if (!chosen[i]) continue;
    users.used.push_back(i);
    users.weight.insert(users.weight.end(), dense.begin() + i * R, dense.begin() + (i + 1) * R);
  }
  return users;
}

constexpr int64_t kTile = 256;  // keys whose partial scores sit in one buffer (R x kTile)
constexpr int64_t kRun = 4096;  // keys per parallel task

#ifdef __AVX512F__
// 64 keys' partial scores for RN rows from r0, held in registers over every used dimension
// (one pass over the runs for up to 4 rows: no accumulator goes through memory per dimension)
template <int RN>
void block_partials(const Users& users, const at::Half* sketch, int64_t sketch_stride,
                    int64_t at, int64_t R, int64_t r0, float* partial, int64_t out_stride = kTile) {
  __m512 acc[RN][4];
  for (int r = 0; r < RN; ++r) {
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  const float* w = users.weight.data() + r0;
  for (const int64_t i : users.used) {
    const at::Half* run = sketch + i * sketch_stride + at;
    __m512 key[4];
    for (int v = 0; v < 4; ++v) {
      key[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 16 * v)));
    }
    for (int r = 0; r < RN; ++r) {
      const __m512 wr = _mm512_set1_ps(w[r]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(wr, key[v], acc[r][v]);
    }
    w += R;
  }
  for (int r = 0; r < RN; ++r) {
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(partial + (r0 + r) * out_stride + 16 * v, acc[r][v]);
  }
}
#endif

// partial (R, kTile) = over keys [begin, begin + len) of one head: each row's weights times the
// sketch's used dimensions. Blocks of 64 keys go through registers, the rest one key at a time;
// the next tile's runs are fetched meanwhile.
void tile_partials(const Users& users, const at::Half* sketch, int64_t sketch_stride,
                   int64_t begin, int64_t len, int64_t R, float* partial) {
  for (const int64_t i : users.used) {
    const char* next = reinterpret_cast<const char*>(sketch + i * sketch_stride + begin + kTile);
    for (int64_t b = 0; b < kTile * 2; b += 64) __builtin_prefetch(next + b);
  }
  int64_t j = 0;
#ifdef __AVX512F__
  for (; j + 64 <= len; j += 64) {
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      switch (std::min<int64_t>(4, R - r0)) {
        case 1: block_partials<1>(users, sketch, sketch_stride, begin + j, R, r0, partial + j); break;
        case 2: block_partials<2>(users, sketch, sketch_stride, begin + j, R, r0, partial + j); break;
        case 3: block_partials<3>(users, sketch, sketch_stride, begin + j, R, r0, partial + j); break;
        default: block_partials<4>(users, sketch, sketch_stride, begin + j, R, r0, partial + j);
      }
    }
  }
#endif
  for (; j < len; ++j) {
    for (int64_t r = 0; r < R; ++r) partial[r * kTile + j] = 0.f;
    for (size_t u = 0; u < users.used.size(); ++u) {
      const float k = static_cast<float>(sketch[users.used[u] * sketch_stride + begin + j]);
      for (int64_t r = 0; r < R; ++r) partial[r * kTile + j] += users.weight[u * R + r] * k;
    }
  }
}

// Every key's exact score for all R rows of one head, keys [first, last): scores (R, n) with
// row stride n. The sketch holds every dimension, so weights q on all of them are the exact
// pre-rotary product (the block-local rotation of the frame's keys cancels: R(o)q . R(o)k = q . k).
void scan_scores(const Users& all, const at::Half* sketch, int64_t sketch_stride, int64_t first,
                 int64_t last, int64_t R, int64_t n, float* scores) {
  int64_t j = first;
#ifdef __AVX512F__
  for (; j + 64 <= last; j += 64) {
    if ((j - first) % kTile == 0) {
      for (const int64_t i : all.used) {
        const char* next = reinterpret_cast<const char*>(sketch + i * sketch_stride + j + kTile);
        for (int64_t b = 0; b < kTile * 2; b += 64) __builtin_prefetch(next + b);
      }
    }
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      switch (std::min<int64_t>(4, R - r0)) {
        case 1: block_partials<1>(all, sketch, sketch_stride, j, R, r0, scores + j, n); break;
        case 2: block_partials<2>(all, sketch, sketch_stride, j, R, r0, scores + j, n); break;
        case 3: block_partials<3>(all, sketch, sketch_stride, j, R, r0, scores + j, n); break;
        default: block_partials<4>(all, sketch, sketch_stride, j, R, r0, scores + j, n);
      }
    }
  }
#endif
  for (; j < last; ++j) {
    for (int64_t r = 0; r < R; ++r) scores[r * n + j] = 0.f;
    for (size_t u = 0; u < all.used.size(); ++u) {
      const float k = static_cast<float>(sketch[all.used[u] * sketch_stride + j]);
      for (int64_t r = 0; r < R; ++r) scores[r * n + j] += all.weight[u * R + r] * k;
    }
  }
}

// The keys of scores (n) at or above bar, as hits.
void collect_at_least(const float* s, int64_t n, float bar, std::vector<Hit>& hits) {
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 b = _mm512_set1_ps(bar);
  for (; j + 16 <= n; j += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + j), b, _CMP_GE_OQ);
    while (m) {
      const int bit = __builtin_ctz(m);
      hits.push_back({s[j + bit], j + bit});
      m &= m - 1;
    }
  }
#endif
  for (; j < n; ++j) {
    if (s[j] >= bar) hits.push_back({s[j], j});
  }
}

// A row's best k of n scores, best first. A bar is read off about 1,024 evenly spaced scores at
// the rank of about 1.5k hits; the hits at or above it are cut to the best k, then sorted. With
// fewer than k at the bar (or n under 2,048), the k-th best score itself is the bar.
std::vector<Hit> top_of_scores(const float* s, int64_t n, int64_t k) {
  const int64_t top = std::min(k, n);
  if (top == 0) return {};
  std::vector<Hit> hits;
  const int64_t stride = std::max<int64_t>(1, n / 1024);
  const int64_t rank = (3 * top / 2) / stride;
  if (stride > 1 && rank > 0) {
    std::vector<float> sample;
    sample.reserve(n / stride + 1);
    for (int64_t j = 0; j < n; j += stride) sample.push_back(s[j]);
    std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<float>());
    collect_at_least(s, n, sample[rank], hits);
  }
  if (static_cast<int64_t>(hits.size()) < top) {
    std::vector<float> all(s, s + n);
    std::nth_element(all.begin(), all.begin() + top - 1, all.end(), std::greater<float>());
    hits.clear();
    collect_at_least(s, n, all[top - 1], hits);
  }
  if (static_cast<int64_t>(hits.size()) > top) {
    std::nth_element(hits.begin(), hits.begin() + top, hits.end(), better);
    hits.resize(top);
  }
  std::sort(hits.begin(), hits.end(), better);
  return hits;
}

// Each row's threshold on its partial scores: the rank of about `want` of n in a sample of
// about 2048 keys (contiguous pieces spread over the memory), so no pass over all n.
std::vector<float> sampled_thresholds(const Users& users, const at::Half* sketch,
                                      int64_t sketch_stride, int64_t n, int64_t R, int64_t want) {
  const int64_t pieces = n <= 8 * kTile ? 1 : 4;
  const int64_t len = pieces == 1 ? n : 2 * kTile;
  std::vector<std::vector<float>> sample(R);
  std::vector<float> partial(R * kTile);
  for (int64_t p = 0; p < pieces; ++p) {
    const int64_t first = pieces == 1 ? 0 : p * (n - len) / (pieces - 1);
    for (int64_t t = 0; t < len; t += kTile) {
      const int64_t l = std::min(kTile, len - t);
      tile_partials(users, sketch, sketch_stride, first + t, l, R, partial.data());
      for (int64_t r = 0; r < R; ++r) {
        sample[r].insert(sample[r].end(), partial.data() + r * kTile, partial.data() + r * kTile + l);
      }
    }
  }
  std::vector<float> out(R);
  for (int64_t r = 0; r < R; ++r) {
    auto& s = sample[r];
    const int64_t size = static_cast<int64_t>(s.size());
    const int64_t rank = std::clamp<int64_t>((want * size + n - 1) / n, 1, size) - 1;
    std::nth_element(s.begin(), s.begin() + rank, s.end(), std::greater<float>());
    out[r] = s[rank];
  }
  return out;
}

// The candidates of one head among keys [begin, end) - every key whose partial score reaches
// its row's threshold for any row, or every key when thresholds is empty - and their exact
// scores for all R rows (scores (candidates, R)), appended in ascending key order.
template <typename T>
void score_run(const Users& users, const at::Half* sketch, int64_t sketch_stride,
               const std::vector<float>& thresholds, const float* rotated, bool block_local,
               const T* keys, int64_t key_stride, int64_t begin, int64_t end, int64_t R,
               int64_t d, int64_t block, std::vector<int64_t>& rows, std::vector<float>& scores) {
  std::vector<float> partial(thresholds.empty() ? 0 : R * kTile);
  int64_t picked[kTile];
  unsigned char flags[kTile];
  float kbuf[kMaxDim];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t len = std::min(kTile, end - t);
    int64_t count = 0;
    if (thresholds.empty()) {
      for (int64_t j = 0; j < len; ++j) picked[count++] = t + j;
    } else {
      tile_partials(users, sketch, sketch_stride, t, len, R, partial.data());
      std::fill(flags, flags + len, 0);
      for (int64_t r = 0; r < R; ++r) {
        const float* p = partial.data() + r * kTile;
        const float bar = thresholds[r];
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) flags[j] |= p[j] >= bar;
      }
      for (int64_t j = 0; j < len; ++j) {
        if (flags[j]) picked[count++] = t + j;
      }
    }
    constexpr int64_t kAhead = 8;  // candidates are scattered: fetch their rows ahead of use
    for (int64_t j = 0; j < count; ++j) {
      if (j + kAhead < count) {
        const char* next = reinterpret_cast<const char*>(keys + picked[j + kAhead] * key_stride);
        for (size_t b = 0; b < d * sizeof(T); b += 64) __builtin_prefetch(next + b);
      }
      const int64_t row = picked[j];
      const float* key = as_floats(keys + row * key_stride, d, kbuf);
      const int64_t offset = block_local ? (row % block) * d : 0;
      rows.push_back(row);
      for (int64_t r = 0; r < R; ++r) {
        scores.push_back(dot(rotated + r * block * d + offset, key, d));
      }
    }
  }
}

// A row's best k of its head's candidates, best first. A bar is read off every 8th score (a
// rank a little past k's share), and the hits at or above it are sorted: when they are at least
// k they hold the best k exactly (every other score is below the bar); else, rarely, the bar is
// the k-th best score itself.
std::vector<Hit> top_hits(const std::vector<const std::vector<int64_t>*>& rows,
                          const std::vector<const std::vector<float>*>& scores, int64_t r,
                          int64_t R, int64_t k) {
  constexpr int64_t kStride = 8;
  std::vector<float> sample;
  int64_t total = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& s = *scores[i];
    const int64_t count = static_cast<int64_t>(rows[i]->size());
    for (int64_t j = (kStride - total % kStride) % kStride; j < count; j += kStride) {
      sample.push_back(s[j * R + r]);
    }
    total += count;
  }
  const int64_t top = std::min(k, total);
  if (top == 0) return {};
  auto collect = [&](float bar) {
    std::vector<Hit> hits;
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& s = *scores[i];
      const auto& ids = *rows[i];
      for (size_t j = 0; j < ids.size(); ++j) {
        if (s[j * R + r] >= bar) hits.push_back({s[j * R + r], ids[j]});
      }
    }
    return hits;
  };
  std::vector<Hit> hits;
  const int64_t rank = (top + top / 4) / kStride;  // the sample's rank for about 1.25 k hits
  if (rank < static_cast<int64_t>(sample.size()) && rank > 0) {
    std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<float>());
    hits = collect(sample[rank]);
  }
  if (static_cast<int64_t>(hits.size()) < top) {  // too few (or too small to sample): exactly
    std::vector<float> all;
    all.reserve(total);
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& s = *scores[i];
      for (size_t j = 0; j < rows[i]->size(); ++j) all.push_back(s[j * R + r]);
    }
    std::nth_element(all.begin(), all.begin() + top - 1, all.end(), std::greater<float>());
    hits = collect(all[top - 1]);
  }
  std::sort(hits.begin(), hits.end(), better);  // ties at the bar: the lower rows kept
  hits.resize(top);
  return hits;
}

// queries (kv_heads, R, d) float32 contiguous, each head's rows in rank order (tokens.py's
// fair_union: the last token's rows first); keys (kv_heads, n, d) float32 or float16 with
// contiguous rows (the frame's memory keys); sketch (kv_heads, d, n) float16, the pre-rotary
// keys dimension-major with contiguous runs; rms (kv_heads, d) float32; cos and sin the rotary
// table (at least `block` rows) when block_local; position >= 0 rotates the queries by that
// table row first (-1: as given).
// -> rows (kv_heads, width) int64: each head's first k distinct hits taken rank by rank over
// its query rows, ascending, -1 padded.
//
// Under candidates a key is a candidate of its head when its partial score reaches any row's
// threshold; every candidate is scored exactly for all the head's rows (its row is read once),
// so a row ranks about `candidates` keys of its own and those its group's other rows brought.
torch::Tensor search(torch::Tensor queries, torch::Tensor keys, torch::Tensor sketch,
                     torch::Tensor rms, torch::Tensor cos, torch::Tensor sin, bool block_local,
                     int64_t k, int64_t block, int64_t dims, int64_t candidates,
                     int64_t position) {
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
  if (block_local || position >= 0) {
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                    cos.sizes() == sin.sizes() && cos.size(1) == d && cos.size(0) >= block &&
                    position < cos.size(0) && d % 2 == 0,
                "token_search: rotary table cos/sin (positions >= block, position, d) float32");
  }
  const float* qp = queries.data_ptr<float>();
  std::vector<float> at_position;  // the queries rotated by `position` first, when given
  if (position >= 0) {
    at_position.resize(kvh * R * d);
    const float *c = cos.data_ptr<float>() + position * d, *s = sin.data_ptr<float>() + position * d;
    for (int64_t row = 0; row < kvh * R; ++row) rotate(qp + row * d, c, s, d, &at_position[row * d]);
    qp = at_position.data();
  }
  const at::Half* sp = sketch.data_ptr<at::Half>();
  std::vector<std::vector<Hit>> hits(kvh * R);
  // Every key exactly, from the sketch, when every dimension is asked for or the candidates
  // would be half the keys or more: (R, n) scores per head, then each row's top k. Streaming the
  // whole sketch costs less than partial scores plus scattered exact reads (decision 051).
  if (dims >= d || 2 * candidates >= n) {
    std::vector<Users> all(kvh);
    for (int64_t h = 0; h < kvh; ++h) {
      all[h].used.resize(d);
      std::iota(all[h].used.begin(), all[h].used.end(), int64_t{0});
      all[h].weight.resize(d * R);
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t i = 0; i < d; ++i) all[h].weight[i * R + r] = qp[(h * R + r) * d + i];
      }
    }
    std::unique_ptr<float[]> scores(new float[kvh * R * n]);
    const int64_t runs = (n + kRun - 1) / kRun;
    at::parallel_for(0, kvh * runs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t at = begin; at < end; ++at) {
        const int64_t h = at / runs, first = (at % runs) * kRun;
        scan_scores(all[h], sp + h * sketch.stride(0), sketch.stride(1), first,
                    std::min(n, first + kRun), R, n, scores.get() + h * R * n);
      }
    });
    at::parallel_for(0, kvh * R, 1, [&](int64_t begin, int64_t end) {
      for (int64_t at = begin; at < end; ++at) hits[at] = top_of_scores(scores.get() + at * n, n, k);
    });
  } else {  // candidates by partial scores, scored exactly on the frame's keys
    const int64_t least = std::min(k, n);
    const int64_t offsets = block_local ? block : 1;
    // each row rotated by every offset a block-local key can have: (kv_heads, R, offsets, d)
    std::vector<float> rotated(kvh * R * offsets * d);
    for (int64_t at = 0; at < kvh * R; ++at) {
      const float* q = qp + at * d;
      float* out = rotated.data() + at * offsets * d;
      if (!block_local) {
        std::copy(q, q + d, out);
        continue;
      }
      const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
      for (int64_t o = 0; o < block; ++o) rotate(q, c + o * d, s + o * d, d, out + o * d);
    }
    // 1. each row's threshold on its partial scores
    std::vector<Users> users(kvh);
    std::vector<std::vector<float>> thresholds(kvh);
    at::parallel_for(0, kvh, 1, [&](int64_t begin, int64_t end) {
      for (int64_t h = begin; h < end; ++h) {
        users[h] = row_dims(qp + h * R * d, R, d, rms.data_ptr<float>() + h * d, dims);
        thresholds[h] = sampled_thresholds(users[h], sp + h * sketch.stride(0), sketch.stride(1),
                                           n, R, std::max(candidates, least + least / 2));
      }
    });
    // 2. per head and run of keys: the candidates and their exact scores
    const int64_t runs = (n + kRun - 1) / kRun;
    std::vector<std::vector<int64_t>> run_rows(kvh * runs);
    std::vector<std::vector<float>> run_scores(kvh * runs);
    auto score = [&](int64_t h, int64_t run) {
      const int64_t first = run * kRun, last = std::min(n, first + kRun);
      auto& ids = run_rows[h * runs + run];
      auto& s = run_scores[h * runs + run];
      ids.clear();
      s.clear();
      const float* rq = rotated.data() + h * R * offsets * d;
      const at::Half* sk = sp + h * sketch.stride(0);
      if (held == at::kHalf) {
        score_run(users[h], sk, sketch.stride(1), thresholds[h], rq, block_local,
                  keys.data_ptr<at::Half>() + h * keys.stride(0), keys.stride(1), first, last, R,
                  d, offsets, ids, s);
      } else {
        score_run(users[h], sk, sketch.stride(1), thresholds[h], rq, block_local,
                  keys.data_ptr<float>() + h * keys.stride(0), keys.stride(1), first, last, R, d,
                  offsets, ids, s);
      }
    };
    at::parallel_for(0, kvh * runs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t at = begin; at < end; ++at) score(at / runs, at % runs);
    });
    for (int64_t h = 0; h < kvh; ++h) {  // a sample far off left too few: score every key
      int64_t found = 0;
      for (int64_t run = 0; run < runs; ++run) found += run_rows[h * runs + run].size();
      if (found < least && !thresholds[h].empty()) {
        thresholds[h].clear();
        for (int64_t run = 0; run < runs; ++run) score(h, run);
      }
    }
    // 3. each row's top k over its head's candidates
    at::parallel_for(0, kvh * R, 1, [&](int64_t begin, int64_t end) {
      for (int64_t at = begin; at < end; ++at) {
        const int64_t h = at / R;
        std::vector<const std::vector<int64_t>*> ids;
        std::vector<const std::vector<float>*> s;
        for (int64_t run = 0; run < runs; ++run) {
          ids.push_back(&run_rows[h * runs + run]);
          s.push_back(&run_scores[h * runs + run]);
        }
        hits[at] = top_hits(ids, s, at % R, R, k);
      }
    });
  }
  // 4. each head's first k distinct rows rank by rank over its query rows, then ascending
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
        const int64_t row = row_hits[rank].second;
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

// decode_attention: one decode token's attention over a KV cache on the CPU, split along the keys
// (flash-decoding): every (kv head, key chunk) task streams its keys and values once, with an
// online softmax for all the queries that share the kv head, and the partial results are merged
// by their log-sum-exp. torch's SDPA handles this shape (1-16 query rows) far below the memory
// bandwidth (docs/decisions/037-lean-decode-step.md).
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
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;  // keys scored before their values are accumulated

float dot(const float* a, const float* b, int64_t d) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < d; ++i) total += a[i] * b[i];
  return total;
}

// d halves widened to floats at out (F16C where the build has it: 8 at a time)
void widen(const at::Half* x, int64_t d, float* out) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= d; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < d; ++i) out[i] = static_cast<float>(x[i]);
}

// Ask for `rows` contiguous rows of d elements at x in L1 ahead of their use. A task's next block
// of keys and values prefetched while it works on this one: the hardware's prefetcher alone left
// a core reading and computing in turn (decision 091).
template <typename T>
inline void prefetch_rows(const T* x, int64_t rows, int64_t d) {
  const char* p = reinterpret_cast<const char*>(x);
  const int64_t bytes = rows * d * static_cast<int64_t>(sizeof(T));
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 3);
}

// Rows of a block as float pointers: in place for float32, widened into buf (kBlock x d) for
// float16. rows[j] = x + index(j) * stride.
template <typename F>
void row_pointers(const float* x, int64_t stride, int64_t n, int64_t, float*, F index,
                  const float** rows) {
  for (int64_t j = 0; j < n; ++j) rows[j] = x + index(j) * stride;
}
template <typename F>
void row_pointers(const at::Half* x, int64_t stride, int64_t n, int64_t d, float* buf, F index,
                  const float** rows) {
  for (int64_t j = 0; j < n; ++j) {
    widen(x + index(j) * stride, d, buf + j * d);
    rows[j] = buf + j * d;
  }
}

// Rows of a block of head h of a piece's keys or values t (float32, or float16 widened into
// buf), as row_pointers gives them
template <typename F>
void piece_rows(const torch::Tensor& t, int64_t h, int64_t n, int64_t d, float* buf, F index,
                const float** rows) {
  if (t.scalar_type() == at::kHalf) {
    row_pointers(t.data_ptr<at::Half>() + h * t.stride(0), t.stride(1), n, d, buf, index, rows);
  } else {
    row_pointers(t.data_ptr<float>() + h * t.stride(0), t.stride(1), n, d, buf, index, rows);
  }
}

// d uint8 codes dequantized at out: zero + code * scale, with a (scale, zero) per channel (s, z:
// d floats each) or, where s is null, the one (s0, z0) of the row (engine/memory/quantized.py)
void dequantize(const uint8_t* c, const float* s, const float* z, float s0, float z0, int64_t d,
                float* out) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 row_scale = _mm256_set1_ps(s0), row_zero = _mm256_set1_ps(z0);
  for (; i + 8 <= d; i += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i));
    const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    const __m256 scale = s ? _mm256_loadu_ps(s + i) : row_scale;
    const __m256 zero = s ? _mm256_loadu_ps(z + i) : row_zero;
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(code, scale, zero));
  }
#endif
  for (; i < d; ++i) out[i] = s ? z[i] + c[i] * s[i] : z0 + c[i] * s0;
}

constexpr int64_t kMaxInt8Dim = 256;  // head_dim the int8 path widens a block's scales for

// Rows of a block of head h of an int8 piece, dequantized into buf (kBlock x d): codes uint8
// (heads, N, d); params float16 (heads, N / group, 2d) [scale | zero] per channel for each
// `group` rows (keys; widened once per group, as rows come in whole groups), or, group 0,
// (heads, N, 2) [scale, zero] per row (values)
template <typename F>
void int8_rows(const torch::Tensor& codes, const torch::Tensor& params, int64_t group, int64_t h,
               int64_t n, int64_t d, float* buf, F index, const float** rows) {
  const uint8_t* cp = codes.data_ptr<uint8_t>() + h * codes.stride(0);
  const at::Half* pp = params.data_ptr<at::Half>() + h * params.stride(0);
  const int64_t cs = codes.stride(1), ps = params.stride(1);
  float scales[2 * kMaxInt8Dim];
  int64_t widened = -1;  // the group whose scales are in `scales`
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = index(j);
    float* out = buf + j * d;
    if (group) {
      if (r / group != widened) {
        widened = r / group;
        widen(pp + widened * ps, 2 * d, scales);
      }
      dequantize(cp + r * cs, scales, scales + d, 0.f, 0.f, d, out);
    } else {
      const at::Half* p = pp + r * ps;
      dequantize(cp + r * cs, nullptr, nullptr, static_cast<float>(p[0]),
                 static_cast<float>(p[1]), d, out);
    }
    rows[j] = out;
  }
}

// Scores of the keys left out (ok[b0 + j] false) set to -FLT_MAX for every query of the group,
// so that the fold gives them no weight (attend_pieces' masks)
inline void mask_out(float* scores, const bool* ok, int64_t b0, int64_t count, int64_t group) {
  if (!ok) return;
  for (int64_t j = 0; j < count; ++j) {
    if (!ok[b0 + j]) {
      for (int64_t g = 0; g < group; ++g) scores[g * kBlock + j] = -FLT_MAX;
    }
  }
}

#include "plain_avx2.h"

#if defined(__AVX2__) && defined(__FMA__)
// the sums of eight vectors, in order
inline __m256 sums8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// a (W vectors) += sum_j p[j] * v[j][0 .. 8W)
template <int W>
void accumulate_rows(const float* p, const float* const* v, int64_t offset, int64_t n, float* a) {
  __m256 acc[W];
  for (int r = 0; r < W; ++r) acc[r] = _mm256_loadu_ps(a + 8 * r);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w = _mm256_set1_ps(p[j]);
    const float* vr = v[j] + offset;
    for (int r = 0; r < W; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * r), acc[r]);
  }
  for (int r = 0; r < W; ++r) _mm256_storeu_ps(a + 8 * r, acc[r]);
}
#endif

// scores[g * kBlock + j] = sc * q[g] . k[j] for the n key rows k[j] and the group's queries q
// (group, d). With AVX2, eight keys at a time, each with its own accumulator.
void score_rows(const float* q, const float* const* k, int64_t n, int64_t group, int64_t d,
                float sc, float* scores) {
#ifdef LONGSERVE_PLAIN_AVX2
  if (plain256::takes(group, d)) {  // each row read once for the group: the same sums
    plain256::score<float>(q, k, n, group, d, sc, scores, nullptr, 0);
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      float* s = scores + g * kBlock;
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {
        __m256 acc[8];
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + i);
          for (int r = 0; r < 8; ++r) {
            acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j + r] + i), acc[r]);
          }
        }
        _mm256_storeu_ps(s + j, _mm256_mul_ps(sums8(acc), _mm256_set1_ps(sc)));
      }
      for (; j < n; ++j) s[j] = dot(qg, k[j], d) * sc;
    }
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t j = 0; j < n; ++j) scores[g * kBlock + j] = dot(q + g * d, k[j], d) * sc;
  }
}

// Fold one block of n scores into a running softmax: scores[g * kBlock + j] (scaled) for each
// of the group's queries become their weights, with the running max m and sum l per query and
// the accumulator a (group, d) rescaled to the new max
void fold_scores(float* scores, int64_t n, int64_t group, int64_t d, float* m, float* l,
                 float* a) {
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
}

// a[g] += sum_j weights[g * kBlock + j] * v[j] for the n value rows v[j]
void accumulate(const float* weights, const float* const* v, int64_t n, int64_t group, int64_t d,
                float* a) {
#ifdef LONGSERVE_PLAIN_AVX2
  if (plain256::takes(group, d)) {  // each row read once for the group: the same sums
    plain256::accumulate<float>(weights, v, n, group, d, a, 0);
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t d0 = 0; d0 < d; d0 += 64) {  // up to 8 vectors of accumulators at a time
        const float* p = weights + g * kBlock;
        float* ag = a + g * d + d0;
        switch (std::min<int64_t>(64, d - d0) / 8) {
          case 8: accumulate_rows<8>(p, v, d0, n, ag); break;
          case 7: accumulate_rows<7>(p, v, d0, n, ag); break;
          case 6: accumulate_rows<6>(p, v, d0, n, ag); break;
          case 5: accumulate_rows<5>(p, v, d0, n, ag); break;
          case 4: accumulate_rows<4>(p, v, d0, n, ag); break;
          case 3: accumulate_rows<3>(p, v, d0, n, ag); break;
          case 2: accumulate_rows<2>(p, v, d0, n, ag); break;
          default: accumulate_rows<1>(p, v, d0, n, ag); break;
        }
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t g = 0; g < group; ++g) {
      const float p = weights[g * kBlock + j];
      float* ag = a + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) ag[i] += p * v[j][i];
    }
  }
}

#include "pieces_avx512.h"

// The (kv head, key chunk) tasks' partial results merged by their log-sum-exp: acc (heads,
// splits, group, d), maxes and sums (heads, splits, group) -> out (heads, group, d)
void merge_into(const float* ap, const float* mp, const float* lp, int64_t heads, int64_t splits,
                int64_t group, int64_t d, float* op) {
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
}

torch::Tensor merge_splits(const torch::Tensor& acc, const torch::Tensor& maxes,
                           const torch::Tensor& sums) {
  const int64_t heads = acc.size(0), splits = acc.size(1), group = acc.size(2), d = acc.size(3);
  auto out = torch::empty({heads, group, d}, acc.options());
  merge_into(acc.data_ptr<float>(), maxes.data_ptr<float>(), sums.data_ptr<float>(), heads,
             splits, group, d, out.data_ptr<float>());
  return out;
}

// A thread's scratch for the tasks it runs, sized for the (group, d) of the last task's job
struct TaskScratch {
  int64_t group = -1, d = -1;
  std::vector<float> scores, kbuf, vbuf;  // a block's scores; float16 rows, widened
  std::vector<float> state;               // a task's running softmax (Running)
#ifdef LONGSERVE_PIECES_AVX512
  std::unique_ptr<pieces512::Scratch> wide;  // for d a multiple of 16
#endif
  void fit(int64_t g, int64_t dim) {
    if (g == group && dim == d) return;
    group = g, d = dim;
    scores.assign(g * kBlock, 0.f), kbuf.assign(kBlock * dim, 0.f), vbuf.assign(kBlock * dim, 0.f);
    state.assign(g * dim + 2 * g, 0.f);
#ifdef LONGSERVE_PIECES_AVX512
    wide = dim % 16 == 0 ? std::make_unique<pieces512::Scratch>(g, dim) : nullptr;
#endif
  }
};

// A task's running softmax (maxes m, sums l, accumulators a of its group's queries) held in the
// thread's scratch while the task runs, and written to the job's slot once, at its end: the
// slots of tasks on the other thread share cache lines with it, and writing them at every block
// made the cores trade those lines back and forth (docs/decisions/096).
struct Running {
  float *m, *l, *a;  // the task's own copy
  float *slot_m, *slot_l, *slot_a;
  int64_t group, d;
  Running(TaskScratch& x, float* m_, float* l_, float* a_, int64_t group_, int64_t d_)
      : slot_m(m_), slot_l(l_), slot_a(a_), group(group_), d(d_) {
    m = x.state.data(), l = m + group, a = l + group;
    std::copy(slot_m, slot_m + group, m);
    std::copy(slot_l, slot_l + group, l);
    std::copy(slot_a, slot_a + group * d, a);
  }
  ~Running() {
    std::copy(m, m + group, slot_m);
    std::copy(l, l + group, slot_l);
    std::copy(a, a + group * d, slot_a);
  }
  Running(const Running&) = delete;
  Running& operator=(const Running&) = delete;
};

// Every task of every job (a DecodeJob or a PiecesJob: its tasks() and run(task, scratch)),
// taken in turn by whichever thread is free rather than dealt out in equal shares: on a shared
// machine one thread can lag, and the others would wait for it at the region's end. A task's
// arithmetic is the same whichever thread runs it, and each job's merge is in task order, so a
// job's result does not depend on the jobs run beside it (a batched step's other rows).
template <typename Job>
void run_jobs(std::vector<Job>& jobs) {
  std::vector<int64_t> starts{0};
  for (const auto& job : jobs) starts.push_back(starts.back() + job.tasks());
  const int64_t tasks = starts.back();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    thread_local TaskScratch scratch;  // its buffers kept across regions
    size_t j = 0;
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      while (task >= starts[j + 1]) ++j;  // a thread's tasks come in increasing order
      jobs[j].run(task - starts[j], scratch);
    }
  });
}

#include "decode_job.h"
#include "pieces_job.h"

}  // namespace

#ifndef LONGSERVE_NO_MODULE  // plain_step.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one decode token's attention (float32, CPU)");
  m.def("attend_pieces", &attend_pieces, "one decode token over pieces of keys (CPU)");
  m.def("attend_pieces_rows", &attend_pieces_rows, "attend_pieces for several rows at once (CPU)");
}
#endif

// A block of float16 or float32 keys with AVX2, for machines without AVX-512 (included by
// decode_attention.cpp): a plain KV cache's, or a memory frame's float pieces. Keys and values
// are read where they are held, each row loaded (and widened) once for the up-to-3 queries of a
// kv head's group, where the generic path widened every row into a float copy and read it once
// per query (docs/decisions/096). Each score and each lane of the accumulator takes the same
// sums in the same order as that path (score_rows, accumulate), so a row's answer is the same
// as before, in any batch.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LONGSERVE_PLAIN_AVX2 1

// decode_attention.cpp's, declared here: this header is included inside that file's namespace,
// after dot, widen and prefetch_rows and before fold_scores
void fold_scores(float* scores, int64_t n, int64_t group, int64_t d, float* m, float* l, float* a);

namespace plain256 {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// the sums of four vectors, lane r a[r]'s, each in sums8's order: ((0+1)+(2+3))+((4+5)+(6+7))
inline __m128 sums4(const __m256* a) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// s[g * kBlock + r] = sc * q[g] . k[r] for four rows k[r] and G queries q (G, d), d a multiple
// of 8: 4 x G accumulators in registers, each key's lanes widened once for all G
template <typename T, int G>
inline void score_four(const float* q, const T* const* k, int64_t d, float sc, float* s) {
  __m256 acc[G][4];
  for (int g = 0; g < G; ++g) {
    for (int r = 0; r < 4; ++r) acc[g][r] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < d; i += 8) {
    for (int r = 0; r < 4; ++r) {
      const __m256 kv = load8(k[r] + i);
      for (int g = 0; g < G; ++g) {
        acc[g][r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + i), kv, acc[g][r]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    _mm_storeu_ps(s + g * kBlock, _mm_mul_ps(sums4(acc[g]), _mm_set1_ps(sc)));
  }
}

// s[g * kBlock + j] = sc * q[g] . k[j] for the n rows k[j] and G queries: eight keys at a time
// (two fours), the rest by dot() on widened rows, as score_rows does
template <typename T, int G>
void score_group(const float* q, const T* const* k, int64_t n, int64_t d, float sc, float* s,
                 float* tail, int64_t ahead) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    if (ahead) {
      for (int r = 0; r < 8; ++r) prefetch_rows(k[j + r] + ahead, 1, d);
    }
    score_four<T, G>(q, k + j, d, sc, s + j);
    score_four<T, G>(q, k + j + 4, d, sc, s + j + 4);
  }
  for (; j < n; ++j) {
    const float* row;
    if constexpr (std::is_same<T, float>::value) {
      row = k[j];
    } else {
      widen(k[j], d, tail);
      row = tail;
    }
    for (int g = 0; g < G; ++g) s[g * kBlock + j] = dot(q + g * d, row, d) * sc;
  }
}

// a[g] (d) += sum_j w[g * kBlock + j] * v[j] for G queries, d a multiple of 32: each value row's
// 32 lanes widened once for all G; each lane's sum over j in order, as accumulate_rows takes it
template <typename T, int G>
void accumulate_group(const float* w, const T* const* v, int64_t n, int64_t d, float* a,
                      int64_t ahead) {
  for (int64_t d0 = 0; d0 < d; d0 += 32) {
    __m256 acc[G][4];
    for (int g = 0; g < G; ++g) {
      for (int r = 0; r < 4; ++r) acc[g][r] = _mm256_loadu_ps(a + g * d + d0 + 8 * r);
    }
    for (int64_t j = 0; j < n; ++j) {
      if (ahead && d0 == 0) prefetch_rows(v[j] + ahead, 1, d);
      const T* vr = v[j] + d0;
      __m256 wj[G];
      for (int g = 0; g < G; ++g) wj[g] = _mm256_set1_ps(w[g * kBlock + j]);
      for (int r = 0; r < 4; ++r) {
        const __m256 vv = load8(vr + 8 * r);
        for (int g = 0; g < G; ++g) acc[g][r] = _mm256_fmadd_ps(wj[g], vv, acc[g][r]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int r = 0; r < 4; ++r) _mm256_storeu_ps(a + g * d + d0 + 8 * r, acc[g][r]);
    }
  }
}

// Whether this path takes a group of `group` queries of d lanes (else the generic path runs)
inline bool takes(int64_t group, int64_t d) { return d % 32 == 0 && group >= 1 && group <= 3; }

// score_group and accumulate_group for a group `takes` accepts
template <typename T>
void score(const float* q, const T* const* k, int64_t n, int64_t group, int64_t d, float sc,
           float* s, float* tail, int64_t ahead) {
  switch (group) {
    case 1: return score_group<T, 1>(q, k, n, d, sc, s, tail, ahead);
    case 2: return score_group<T, 2>(q, k, n, d, sc, s, tail, ahead);
    default: return score_group<T, 3>(q, k, n, d, sc, s, tail, ahead);
  }
}

template <typename T>
void accumulate(const float* w, const T* const* v, int64_t n, int64_t group, int64_t d, float* a,
                int64_t ahead) {
  switch (group) {
    case 1: return accumulate_group<T, 1>(w, v, n, d, a, ahead);
    case 2: return accumulate_group<T, 2>(w, v, n, d, a, ahead);
    default: return accumulate_group<T, 3>(w, v, n, d, a, ahead);
  }
}

// The n rows k[j], v[j] folded into the running softmax (m, l, a) of a group of queries q
// (group, d), a shape `takes` accepts; tail: d floats
template <typename T>
void fold_rows(const T* const* k, const T* const* v, int64_t n, const float* q, int64_t group,
               int64_t d, float sc, float* scores, float* tail, float* m, float* l, float* a,
               int64_t ahead) {
  score<T>(q, k, n, group, d, sc, scores, tail, ahead);
  fold_scores(scores, n, group, d, m, l, a);
  accumulate<T>(scores, v, n, group, d, a, ahead);
}

}  // namespace plain256

#endif

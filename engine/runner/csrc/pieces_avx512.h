// attend_pieces' block of keys with AVX-512 (included by decode_attention.cpp): keys and values
// are read straight from memory as they are held (float32, float16, or int8 codes), 16 lanes at
// a time, with no widened copy of the block. int8 keys are scored against the query scaled by
// their channels' scales, q . (z + c * s) = q . z + (q * s) . c, and int8 values are summed as
// codes under the weights times their rows' scales, plus the weights times their zeros
// (engine/memory/quantized.py holds them so; docs/decisions/084).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define LONGSERVE_PIECES_AVX512 1

namespace pieces512 {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}

// the sums of eight 16-lane vectors, in order: a tree of 512-bit shuffles and adds (24
// instructions, where halving each and summing by hadd took 37)
inline __m256 sums8_wide(const __m512* a) {
  __m512 t[4], u[2];
  for (int r = 0; r < 4; ++r) {  // t[r]: a[2r]'s 8 partial sums in blocks 0-1, a[2r+1]'s in 2-3
    t[r] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * r], a[2 * r + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * r], a[2 * r + 1], 0xEE));
  }
  for (int r = 0; r < 2; ++r) {  // u[r]: block i holds a[4r + i]'s 4 partial sums
    u[r] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * r], t[2 * r + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * r], t[2 * r + 1], 0xDD));
  }
  // block i: lane 0 a[i]'s sum, lane 1 a[i + 4]'s
  const __m512 w = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 z = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));
  const __m512i order = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, z));
}

// score for a group of G queries on float16 keys or int8 codes: each key's 16 lanes loaded and
// widened once for all G queries, not once per query; 8 keys x G accumulators stay in registers
// for G <= 3. The same sums in the same order as the loop below, so the same scores. int8 codes
// are converted here where they are read, with no float copy of the block (docs/decisions/086).
template <typename T, int G>
void score_group(const float* q, const T* const* k, int64_t n, int64_t d, const float* bias,
                 float sc, float* s, int64_t ahead = 0) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    if (ahead) {
      for (int r = 0; r < 8; ++r) prefetch_rows(k[j + r] + ahead, 1, d);
    }
    __m512 acc[G][8];
    for (int g = 0; g < G; ++g) {
      for (int r = 0; r < 8; ++r) acc[g][r] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < d; i += 16) {
      __m512 qv[G];
      for (int g = 0; g < G; ++g) qv[g] = _mm512_loadu_ps(q + g * d + i);
      for (int r = 0; r < 8; ++r) {
        const __m512 kv = load16(k[j + r] + i);
        for (int g = 0; g < G; ++g) acc[g][r] = _mm512_fmadd_ps(qv[g], kv, acc[g][r]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256 t = _mm256_add_ps(sums8_wide(acc[g]), _mm256_set1_ps(bias ? bias[g] : 0.f));
      _mm256_storeu_ps(s + g * kBlock + j, _mm256_mul_ps(t, _mm256_set1_ps(sc)));
    }
  }
  for (; j < n; ++j) {
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + i), load16(k[j] + i), acc);
      }
      s[g * kBlock + j] = (_mm512_reduce_add_ps(acc) + (bias ? bias[g] : 0.f)) * sc;
    }
  }
}

// s[g * kBlock + j] = sc * (q[g] . k[j] + bias[g]) for n rows k[j] and the group's queries q
// (group, d); bias null for none. Eight keys at a time, each with its own accumulator.
template <typename T>
void score(const float* q, const T* const* k, int64_t n, int64_t group, int64_t d,
           const float* bias, float sc, float* s, int64_t ahead = 0) {
  if constexpr (std::is_same<T, at::Half>::value) {
    switch (group) {
      case 1: return score_group<T, 1>(q, k, n, d, bias, sc, s, ahead);
      case 2: return score_group<T, 2>(q, k, n, d, bias, sc, s, ahead);
      case 3: return score_group<T, 3>(q, k, n, d, bias, sc, s, ahead);
      default: break;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * d;
    const float b = bias ? bias[g] : 0.f;
    float* sg = s + g * kBlock;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m512 acc[8];
      for (int r = 0; r < 8; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) {
        const __m512 qv = _mm512_loadu_ps(qg + i);
        for (int r = 0; r < 8; ++r) acc[r] = _mm512_fmadd_ps(qv, load16(k[j + r] + i), acc[r]);
      }
      const __m256 t = _mm256_add_ps(sums8_wide(acc), _mm256_set1_ps(b));
      _mm256_storeu_ps(sg + j, _mm256_mul_ps(t, _mm256_set1_ps(sc)));
    }
    for (; j < n; ++j) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + i), load16(k[j] + i), acc);
      }
      sg[j] = (_mm512_reduce_add_ps(acc) + b) * sc;
    }
  }
}

// a[0 .. 16W) += sum_j w[j] * v[j][offset ..]
template <typename T, int W>
void accumulate_rows(const float* w, const T* const* v, int64_t offset, int64_t n, float* a) {
  __m512 acc[W];
  for (int r = 0; r < W; ++r) acc[r] = _mm512_loadu_ps(a + 16 * r);
  for (int64_t j = 0; j < n; ++j) {
    const __m512 wj = _mm512_set1_ps(w[j]);
    const T* vr = v[j] + offset;
    for (int r = 0; r < W; ++r) acc[r] = _mm512_fmadd_ps(wj, load16(vr + 16 * r), acc[r]);
  }
  for (int r = 0; r < W; ++r) _mm512_storeu_ps(a + 16 * r, acc[r]);
}

// a (d) += sum_j w[j] * v[j], 64 lanes of accumulators at a time
template <typename T>
void accumulate(const float* w, const T* const* v, int64_t n, int64_t d, float* a) {
  for (int64_t d0 = 0; d0 < d; d0 += 64) {
    switch (std::min<int64_t>(64, d - d0) / 16) {
      case 4: accumulate_rows<T, 4>(w, v, d0, n, a + d0); break;
      case 3: accumulate_rows<T, 3>(w, v, d0, n, a + d0); break;
      case 2: accumulate_rows<T, 2>(w, v, d0, n, a + d0); break;
      default: accumulate_rows<T, 1>(w, v, d0, n, a + d0); break;
    }
  }
}

// a[g] (d) += sum_j w[g * kBlock + j] * v[j] for a group of G queries (float32 or float16
// values, int8 codes), d a multiple of 64: each value row's 64 lanes widened once for all G, not
// once per query (as score_group does for keys); the same sums in the same order as accumulate's.
template <typename T, int G>
void accumulate_group(const float* w, const T* const* v, int64_t n, int64_t d, float* a,
                      int64_t ahead = 0) {
  if (ahead) {
    for (int64_t j = 0; j < n; ++j) prefetch_rows(v[j] + ahead, 1, d);
  }
  for (int64_t d0 = 0; d0 < d; d0 += 64) {
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g) {
      for (int r = 0; r < 4; ++r) acc[g][r] = _mm512_loadu_ps(a + g * d + d0 + 16 * r);
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = v[j] + d0;
      __m512 vv[4];
      for (int r = 0; r < 4; ++r) vv[r] = load16(vr + 16 * r);
      for (int g = 0; g < G; ++g) {
        const __m512 wj = _mm512_set1_ps(w[g * kBlock + j]);
        for (int r = 0; r < 4; ++r) acc[g][r] = _mm512_fmadd_ps(wj, vv[r], acc[g][r]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int r = 0; r < 4; ++r) _mm512_storeu_ps(a + g * d + d0 + 16 * r, acc[g][r]);
    }
  }
}

// n rows of d codes as floats at out (row j at out + j * d): converted once per block, not once
// per query of the group (three instructions per 16 codes)
inline void codes_to_floats(const uint8_t* const* rows, int64_t n, int64_t d, float* out,
                            const float** at) {
  for (int64_t j = 0; j < n; ++j) {
    float* o = out + j * d;
    for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(o + i, load16(rows[j] + i));
    at[j] = o;
  }
}

// int8 values (v = zero + code * scale, per row) under weights w: wc[j] = w[j] * scale[j], the
// weights the codes take; returns sum_j w[j] * zero[j], added to every lane afterwards
inline float scaled_weights(const float* w, const float* scale, const float* zero, int64_t n,
                            float* wc) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < n; ++j) {
    wc[j] = w[j] * scale[j];
    total += w[j] * zero[j];
  }
  return total;
}

// Where a block's keys and values are, and how its int8 codes are scaled
struct Piece {
  const void* k;
  const void* v;
  int64_t ks, vs;        // row strides (elements)
  const at::Half* kp;    // int8 keys: (scale | zero) per channel, per qgroup rows; else null
  const at::Half* vp;    // int8 values: (scale, zero) per row
  int64_t kps, vps;      // their row strides
  int64_t qgroup;
  int64_t ahead = 0;  // contiguous rows: the next block's row this many elements on, prefetched
};

// Head h of a piece's keys k and values v (int8 codes: with their params kp and vp, keys'
// scales per qgroup rows)
template <typename T>
Piece piece(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& kp,
            const torch::Tensor& vp, int64_t qgroup, int64_t h) {
  const bool codes = std::is_same<T, uint8_t>::value;
  return Piece{k.data_ptr<T>() + h * k.stride(0),
               v.data_ptr<T>() + h * v.stride(0),
               k.stride(1),
               v.stride(1),
               codes ? kp.data_ptr<at::Half>() + h * kp.stride(0) : nullptr,
               codes ? vp.data_ptr<at::Half>() + h * vp.stride(0) : nullptr,
               codes ? kp.stride(1) : 0,
               codes ? vp.stride(1) : 0,
               qgroup};
}

// A task's scratch: a block's scores (group x kBlock); int8 values' weighted scales and their
// rows' (scale, zero); int8 keys' scaled queries and their biases, a run's key scales; int8
// codes as floats
struct Scratch {
  std::vector<float> scores, weights, value_scales, value_zeros, qs, key_scales, kbuf, vbuf;
  Scratch(int64_t group, int64_t d)
      : scores(group * kBlock),
        weights(group * kBlock),
        value_scales(kBlock),
        value_zeros(kBlock),
        qs(group * d + group),
        key_scales(2 * d),
        kbuf(kBlock * d),
        vbuf(kBlock * d) {}
};

// The `count` keys of head h's piece from b0 (index(j): the row of key j) folded into the
// running softmax (m, l, a): queries qp (nq, group, d) with one query per `per` keys, keys left
// out where ok is false.
template <typename T, typename F>
void fold_block(const Piece& p, F index, int64_t b0, int64_t count, const float* qp, int64_t per,
                int64_t group, int64_t d, float sc, const bool* ok, Scratch& x, float* m,
                float* l, float* a) {
  const T* krows[kBlock];
  const T* vrows[kBlock];
  int64_t at[kBlock];
  for (int64_t j = 0; j < count; ++j) {
    at[j] = index(j);
    krows[j] = static_cast<const T*>(p.k) + at[j] * p.ks;
    vrows[j] = static_cast<const T*>(p.v) + at[j] * p.vs;
  }
  float* scores = x.scores.data();
  const float* kfloats[kBlock];  // int8 codes as floats
  const float* vfloats[kBlock];
  // a group of up to 3 queries converts each code once where it reads it: no float copy
  const bool grouped = d % 64 == 0 && group <= 3;
  if constexpr (std::is_same<T, uint8_t>::value) {
    if (!grouped) {
      codes_to_floats(krows, count, d, x.kbuf.data(), kfloats);
      codes_to_floats(vrows, count, d, x.vbuf.data(), vfloats);
    }
  }
  for (int64_t j0 = 0; j0 < count;) {  // runs of keys that share a query (and int8 scales)
    const int64_t qi = (b0 + j0) / per;
    int64_t j1 = std::min(count, (qi + 1) * per - b0);
    const float* q = qp + qi * group * d;
    if constexpr (std::is_same<T, uint8_t>::value) {
      const int64_t sg = at[j0] / p.qgroup;
      for (int64_t j = j0 + 1; j < j1; ++j) {
        if (at[j] / p.qgroup != sg) {
          j1 = j;
          break;
        }
      }
      float* scale = x.key_scales.data();  // this run's (scale | zero) per channel
      widen(p.kp + sg * p.kps, 2 * d, scale);
      float* qs = x.qs.data();
      float* bias = qs + group * d;  // q . zero, per query
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = 0; i < d; ++i) qs[g * d + i] = q[g * d + i] * scale[i];
        bias[g] = dot(q + g * d, scale + d, d);
      }
      if (grouped) {
        switch (group) {
          case 1: score_group<uint8_t, 1>(qs, krows + j0, j1 - j0, d, bias, sc, scores + j0, p.ahead); break;
          case 2: score_group<uint8_t, 2>(qs, krows + j0, j1 - j0, d, bias, sc, scores + j0, p.ahead); break;
          default: score_group<uint8_t, 3>(qs, krows + j0, j1 - j0, d, bias, sc, scores + j0, p.ahead); break;
        }
      } else {
        score<float>(qs, kfloats + j0, j1 - j0, group, d, bias, sc, scores + j0);
      }
    } else {
      score<T>(q, krows + j0, j1 - j0, group, d, nullptr, sc, scores + j0, p.ahead);
    }
    j0 = j1;
  }
  mask_out(scores, ok, b0, count, group);
  fold_scores(scores, count, group, d, m, l, a);
  float* vscale = x.value_scales.data();  // int8 values' (scale, zero) per row, as floats
  float* vzero = x.value_zeros.data();
  if constexpr (std::is_same<T, uint8_t>::value) {
    for (int64_t j = 0; j < count; ++j) {
      int32_t pair;
      std::memcpy(&pair, p.vp + at[j] * p.vps, sizeof(pair));
      const __m128 sz = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
      vscale[j] = _mm_cvtss_f32(sz);
      vzero[j] = _mm_cvtss_f32(_mm_shuffle_ps(sz, sz, 1));
    }
  }
  if (grouped) {  // each value row read once for the group's queries
    const float* w = scores;
    float zeros[3] = {0.f, 0.f, 0.f};
    if constexpr (std::is_same<T, uint8_t>::value) {  // v = zero + code * scale, per row
      float* wc = x.weights.data();
      for (int64_t g = 0; g < group; ++g) {
        const float* wg = scores + g * kBlock;
        float* wcg = wc + g * kBlock;
        zeros[g] = scaled_weights(wg, vscale, vzero, count, wcg);
      }
      w = wc;
    }
    switch (group) {  // int8: the codes under the weights times their rows' scales
      case 1: accumulate_group<T, 1>(w, vrows, count, d, a, p.ahead); break;
      case 2: accumulate_group<T, 2>(w, vrows, count, d, a, p.ahead); break;
      default: accumulate_group<T, 3>(w, vrows, count, d, a, p.ahead); break;
    }
    if constexpr (std::is_same<T, uint8_t>::value) {
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = 0; i < d; ++i) a[g * d + i] += zeros[g];
      }
    }
    return;
  }
  for (int64_t g = 0; g < group; ++g) {
    const float* w = scores + g * kBlock;
    float* ag = a + g * d;
    if constexpr (std::is_same<T, uint8_t>::value) {  // v = zero + code * scale, per row
      float* wc = x.weights.data();
      const float zero = scaled_weights(w, vscale, vzero, count, wc);
      accumulate<float>(wc, vfloats, count, d, ag);
      for (int64_t i = 0; i < d; ++i) ag[i] += zero;
    } else {
      accumulate<T>(w, vrows, count, d, ag);
    }
  }
}

}  // namespace pieces512

#endif

// Quantized weights times a few rows of float activations (decode steps), for the CPU.
//
// q4_matmul: 4-bit codes in blocks of 32 inputs, each block with a scale d and a minimum m
// (w = q d + m: Q4_1 and Q4_K's grids), or no minimums where m = -8 d (Q4_0's grid). q8_matmul: int8 codes with a scale per block of
// 32 or of 16 inputs and, optionally, a minimum per 32 (Q8_0, Q5_0, Q5_1, Q5_K; Q6_K's blocks
// of 16).
// The activations are quantized to int16 per block of 32 (scale = max |x| / 32767) and
// multiplied with integer dot products (AVX2 madd); each block's sum of x is kept exact in fp32
// for the minimum's term. (llama.cpp quantizes them to int8; int16 costs about the same here
// and keeps the products within 1e-4 of fp32's: docs/decisions/038.) Output rows are split across
// torch's intra-op threads; every thread reads each weight byte once for all activation rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;  // inputs per block

constexpr float ACT_MAX = 32767.f;

// x (M, K) -> int16 codes (M, K), a scale and an exact sum per block (M, K / QK).
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* q, float* d, float* s) {
  const int64_t nb = K / QK;
  for (int64_t r = 0; r < M * nb; ++r) {
    const float* xb = x + r * QK;
    float amax = 0.f, sum = 0.f;
    for (int64_t j = 0; j < QK; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      sum += xb[j];
    }
    const float scale = amax / ACT_MAX;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t j = 0; j < QK; ++j) q[r * QK + j] = static_cast<int16_t>(std::nearbyint(xb[j] * inv));
    d[r] = scale;
    s[r] = sum;
  }
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// sum over 32 int16 lanes (lo: 0-15, hi: 16-31) of w times x at xq, as 8 float partial sums
inline __m256 dot_s16(__m256i lo, __m256i hi, const int16_t* xq) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
  const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
  return _mm256_cvtepi32_ps(sum);
}

// one block's 16 bytes of codes as int16: lo = q[0..15] (low nibbles), hi = q[16..31]
inline void unpack_q4(const uint8_t* block, __m256i& lo, __m256i& hi) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
  const __m128i low = _mm_set1_epi8(0x0F);
  lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low));
  hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
}
#endif

// an output row's minimum term: sum over its blocks of m times the block's exact sum of x
inline float min_term(const float* mn, const float* xs, int64_t nb) {
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) total += mn[b] * xs[b];
  return total;
}

// q4's: without minimums (mn null), Q4_0's grid w = (q - 8) d, whose minimum is -8 d: the
// weights' bytes a step reads are then the codes and one scale per block, not two floats
inline float q4_min_term(const float* mn, const float* d, const float* xs, int64_t nb) {
  return mn ? min_term(mn, xs, nb) : -8.f * min_term(d, xs, nb);
}

// An int8 weight matrix: codes (N, K), a scale per block of 32 inputs or, `half`, per 16
// (Q6_K's blocks), and a minimum per 32 where `mins` is not null (w = q d + m).
struct Q8Weights {
  const int8_t* codes;
  const float* scales;
  const float* mins;
  bool half;
};

// an output row's minimum term, where the weights have minimums
inline float q8_min_term(const Q8Weights& w, int64_t n, const float* xs, int64_t nb) {
  return w.mins ? min_term(w.mins + n * nb, xs, nb) : 0.f;
}

constexpr int64_t MAX_ROWS = 16;
// activation rows multiplied per pass over the weights: 8 accumulators and the block's
// operands fit AVX2's 16 vector registers
constexpr int64_t CHUNK_ROWS = 8;

#if defined(__AVX2__)
// Output rows [n0, n1) of q4 for R activation rows (a compile-time count, so that the
// accumulators stay in registers): y (R, N) fp32.
template <int R>
void q4_rows_avx2(const uint8_t* codes, const float* wd, const float* wm, const int16_t* xq,
                  const float* xd, const float* xs, int64_t N, int64_t K, int64_t n0, int64_t n1,
                  float* y) {
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * (K / 2);
    const float* d = wd + n * nb;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i lo, hi;
      unpack_q4(row + b * 16, lo, hi);
      const __m256 db = _mm256_set1_ps(d[b]);
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_mul_ps(db, _mm256_set1_ps(xd[r * nb + b]));
        acc[r] = _mm256_fmadd_ps(dot_s16(lo, hi, xq + (r * nb + b) * QK), scale, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      y[r * N + n] = hsum(acc[r]) + q4_min_term(wm ? wm + n * nb : nullptr, d, xs + r * nb, nb);
    }
  }
}

#if defined(__AVX512BW__) && defined(__AVX512DQ__)
// q4_rows_avx2 two blocks at a time: a 512-bit vector holds block b's 16 codes or inputs in
// lanes 0-15 and block b + 1's in lanes 16-31; an odd last block goes 256 bits wide.
// The activations come in pair_layout's order, so that each block pair's operands are two
// plain loads rather than four loads and two inserts per output row.
template <int R>
void q4_rows_avx512(const uint8_t* codes, const float* wd, const float* wm, const int16_t* xq,
                    const float* xd, const float* xs, const float* xdp, int64_t N, int64_t K,
                    int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / QK;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * (K / 2);
    const float* d = wd + n * nb;
    __m512 acc[R];
    float rest[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), rest[r] = 0.f;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 16));
      const __m512i lo = _mm512_cvtepu8_epi16(_mm256_and_si256(raw, low));  // q[0..15] of each
      const __m512i hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
      const __m512 db = _mm512_insertf32x8(_mm512_set1_ps(d[b]), _mm256_set1_ps(d[b + 1]), 1);
      for (int r = 0; r < R; ++r) {
        const int16_t* x = xq + (r * nb + b) * QK;  // low halves of b, b + 1; then high halves
        const __m512i sum = _mm512_add_epi32(
            _mm512_madd_epi16(lo, _mm512_loadu_si512(x)),
            _mm512_madd_epi16(hi, _mm512_loadu_si512(x + 32)));
        const __m512 xdb = _mm512_loadu_ps(xdp + (r * nb + b) * 8);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(db, xdb), acc[r]);
      }
    }
    if (b < nb) {
      __m256i lo, hi;
      unpack_q4(row + b * 16, lo, hi);
      for (int r = 0; r < R; ++r) {
        rest[r] = hsum(dot_s16(lo, hi, xq + (r * nb + b) * QK)) * d[b] * xd[r * nb + b];
      }
    }
    for (int r = 0; r < R; ++r) {
      const float mins = q4_min_term(wm ? wm + n * nb : nullptr, d, xs + r * nb, nb);
      y[r * N + n] = _mm512_reduce_add_ps(acc[r]) + rest[r] + mins;
    }
  }
}
#endif

template <int R, bool HALF>
void q8_rows_avx2(const Q8Weights& w, const int16_t* xq, const float* xd, const float* xs,
                  int64_t N, int64_t K, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w.codes + n * K;
    const float* d = w.scales + n * (HALF ? 2 * nb : nb);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m128i w0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * QK));
      const __m128i w1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * QK + 16));
      const __m256i lo = _mm256_cvtepi8_epi16(w0), hi = _mm256_cvtepi8_epi16(w1);
      for (int r = 0; r < R; ++r) {
        const int16_t* x = xq + (r * nb + b) * QK;
        const float xdr = xd[r * nb + b];
        if constexpr (HALF) {  // each 16 of the block with its own scale
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
          const __m256 p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(lo, x0));
          const __m256 p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(hi, x1));
          // one add into the accumulator per block (the 32-wide path has one fma): two
          // dependent fmas into it took twice as long (bench gguf_products, one thread)
          const __m256 first = _mm256_mul_ps(p0, _mm256_set1_ps(xdr * d[2 * b]));
          acc[r] = _mm256_add_ps(acc[r], _mm256_fmadd_ps(p1, _mm256_set1_ps(xdr * d[2 * b + 1]), first));
        } else {
          acc[r] = _mm256_fmadd_ps(dot_s16(lo, hi, x), _mm256_set1_ps(xdr * d[b]), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) y[r * N + n] = hsum(acc[r]) + q8_min_term(w, n, xs + r * nb, nb);
  }
}

// Output rows [n0, n1) of q8 for M activation rows, CHUNK_ROWS at a time.
template <bool HALF>
void q8_chunks(const Q8Weights& w, const int16_t* xq, const float* xd, const float* xs, int64_t M,
               int64_t N, int64_t K, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / QK;
  for (int64_t r0 = 0; r0 < M; r0 += CHUNK_ROWS) {
    const int16_t* x = xq + r0 * nb * QK;
    const float *d = xd + r0 * nb, *s = xs + r0 * nb;
    float* out = y + r0 * N;
    switch (std::min<int64_t>(CHUNK_ROWS, M - r0)) {
      case 1: q8_rows_avx2<1, HALF>(w, x, d, s, N, K, n0, n1, out); break;
      case 2: q8_rows_avx2<2, HALF>(w, x, d, s, N, K, n0, n1, out); break;
      case 3: q8_rows_avx2<3, HALF>(w, x, d, s, N, K, n0, n1, out); break;
      case 4: q8_rows_avx2<4, HALF>(w, x, d, s, N, K, n0, n1, out); break;
      case 5: q8_rows_avx2<5, HALF>(w, x, d, s, N, K, n0, n1, out); break;
      case 6: q8_rows_avx2<6, HALF>(w, x, d, s, N, K, n0, n1, out); break;
      case 7: q8_rows_avx2<7, HALF>(w, x, d, s, N, K, n0, n1, out); break;
      default: q8_rows_avx2<8, HALF>(w, x, d, s, N, K, n0, n1, out);
    }
  }
}

#endif

// The widest q4 kernel the build's vector extensions allow.
#if defined(__AVX512BW__) && defined(__AVX512DQ__)
#define Q4_PAIRS 1
// xdp's extra argument, and the rows' offset into it
#define Q4_ROWS(R) q4_rows_avx512<R>(codes, wd, wm, x, d, s, xdp + r0 * nb * 8, N, K, n0, n1, out)
#else
#define Q4_PAIRS 0
#define Q4_ROWS(R) q4_rows_avx2<R>(codes, wd, wm, x, d, s, N, K, n0, n1, out)
#endif

// Activations (M, K) rearranged for q4_rows_avx512, in place: within each pair of blocks,
// both blocks' first 16 codes, then both blocks' last 16 (an odd last block stays as it is);
// xdp (M, K / QK * 8) the pair's two scales, each repeated 8 times, as one 512-bit operand.
void pair_layout(int16_t* xq, const float* xd, int64_t M, int64_t K, float* xdp) {
  const int64_t nb = K / QK;
  int16_t pair[2 * QK];
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b + 2 <= nb; b += 2) {
      int16_t* x = xq + (r * nb + b) * QK;
      std::copy(x, x + 16, pair);
      std::copy(x + 32, x + 48, pair + 16);
      std::copy(x + 16, x + 32, pair + 32);
      std::copy(x + 48, x + 64, pair + 48);
      std::copy(pair, pair + 2 * QK, x);
      float* s = xdp + (r * nb + b) * 8;
      std::fill(s, s + 8, xd[r * nb + b]);
      std::fill(s + 8, s + 16, xd[r * nb + b + 1]);
    }
  }
}

// Output rows [n0, n1) of q4: y (M, N) fp32. xq in pair_layout's order where Q4_PAIRS.
void q4_rows(const uint8_t* codes, const float* wd, const float* wm, const int16_t* xq,
             const float* xd, const float* xs, const float* xdp, int64_t M, int64_t N,
             int64_t K, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / QK;
  (void)xdp;
#if defined(__AVX2__)
  for (int64_t r0 = 0; r0 < M; r0 += CHUNK_ROWS) {  // accumulators stay in registers
    const int16_t* x = xq + r0 * nb * QK;
    const float *d = xd + r0 * nb, *s = xs + r0 * nb;
    float* out = y + r0 * N;
    switch (std::min<int64_t>(CHUNK_ROWS, M - r0)) {
      case 1: Q4_ROWS(1); break;
      case 2: Q4_ROWS(2); break;
      case 3: Q4_ROWS(3); break;
      case 4: Q4_ROWS(4); break;
      case 5: Q4_ROWS(5); break;
      case 6: Q4_ROWS(6); break;
      case 7: Q4_ROWS(7); break;
      default: Q4_ROWS(8);
    }
  }
#else
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * (K / 2);
    for (int64_t r = 0; r < M; ++r) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        const int16_t* xb = xq + (r * nb + b) * QK;
        for (int64_t j = 0; j < 16; ++j) {
          const uint8_t byte = row[b * 16 + j];
          dot += (byte & 0x0F) * xb[j] + (byte >> 4) * xb[16 + j];
        }
        const float mn = wm ? wm[n * nb + b] : -8.f * wd[n * nb + b];
        total += wd[n * nb + b] * xd[r * nb + b] * dot + mn * xs[r * nb + b];
      }
      y[r * N + n] = total;
    }
  }
#endif
}

// Output rows [n0, n1) of q8: y (M, N) fp32.
void q8_rows(const Q8Weights& w, const int16_t* xq, const float* xd, const float* xs, int64_t M,
             int64_t N, int64_t K, int64_t n0, int64_t n1, float* y) {
#if defined(__AVX2__)
  if (w.half) {
    q8_chunks<true>(w, xq, xd, xs, M, N, K, n0, n1, y);
  } else {
    q8_chunks<false>(w, xq, xd, xs, M, N, K, n0, n1, y);
  }
#else
  const int64_t nb = K / QK, per_scale = w.half ? QK / 2 : QK;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w.codes + n * K;
    const float* d = w.scales + n * (K / per_scale);
    for (int64_t r = 0; r < M; ++r) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        for (int64_t j0 = 0; j0 < QK; j0 += per_scale) {
          int32_t dot = 0;
          for (int64_t j = j0; j < j0 + per_scale; ++j)
            dot += row[b * QK + j] * xq[(r * nb + b) * QK + j];
          total += d[(b * QK + j0) / per_scale] * xd[r * nb + b] * dot;
        }
      }
      y[r * N + n] = total + q8_min_term(w, n, xs + r * nb, nb);
    }
  }
#endif
}

struct Quantized {
  std::vector<int16_t> q;
  std::vector<float> d, s;
};

Quantized quantize(const float* x, int64_t M, int64_t K) {
  Quantized out{std::vector<int16_t>(M * K), std::vector<float>(M * K / QK),
                std::vector<float>(M * K / QK)};
  quantize_rows(x, M, K, out.q.data(), out.d.data(), out.s.data());
  return out;
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "x: float32 on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && K % QK == 0, "x: (M, K), K a multiple of 32");
  TORCH_CHECK(x.size(0) <= MAX_ROWS, "x: at most 16 rows");
}

int64_t grain(int64_t N) { return std::max<int64_t>(16, N / (8 * at::get_num_threads())); }

// y (M, N) = x (M, K) times the 4-bit codes (N, K/2) with their block scales and minimums.
void q4_into(const float* x, int64_t M, const torch::Tensor& codes, const torch::Tensor& scales,
             const torch::Tensor& mins, float* y) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  Quantized xq = quantize(x, M, K);
  std::vector<float> xdp(Q4_PAIRS ? M * (K / QK) * 8 : 0);
  if (Q4_PAIRS) pair_layout(xq.q.data(), xq.d.data(), M, K, xdp.data());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* d = scales.data_ptr<float>();
  const float* m = mins.numel() > 0 ? mins.data_ptr<float>() : nullptr;
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    q4_rows(c, d, m, xq.q.data(), xq.d.data(), xq.s.data(), xdp.data(), M, N, K, n0, n1, y);
  });
}

// Llama's RMSNorm of rows x (M, K) into out: x * rsqrt(mean(x^2) + eps) * w.
void rms_rows(const float* x, const float* w, float eps, int64_t M, int64_t K, float* out) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * K;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < K; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / K + eps);
#pragma omp simd
    for (int64_t i = 0; i < K; ++i) out[r * K + i] = xr[i] * inv * w[i];
  }
}

void check_q4(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& mins,
              int64_t K) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() &&
                  codes.size(1) * 2 == K,
              "codes: uint8 (N, K/2)");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.dim() == 2 &&
                  scales.is_contiguous() && scales.size(0) == codes.size(0) &&
                  scales.size(1) == K / QK,
              "scales: (N, K/32) float32 contiguous");
  TORCH_CHECK(mins.numel() == 0 || (mins.scalar_type() == torch::kFloat32 &&
                                    mins.is_contiguous() && scales.sizes() == mins.sizes()),
              "mins: (N, K/32) float32 contiguous, or empty for Q4_0's grid (-8 times the scale)");
}

void check_q8(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& mins,
              int64_t K) {
  const int64_t N = codes.size(0);
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && codes.size(1) == K,
              "codes: int8 (N, K)");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.dim() == 2 &&
                  scales.size(0) == N &&
                  (scales.size(1) == K / QK || scales.size(1) == 2 * (K / QK)) &&
                  scales.is_contiguous(),
              "scales: (N, K/32) or (N, K/16) float32");
  TORCH_CHECK(mins.numel() == 0 ||
                  (mins.scalar_type() == torch::kFloat32 && mins.dim() == 2 &&
                   mins.size(0) == N && mins.size(1) == K / QK && mins.is_contiguous()),
              "mins: (N, K/32) float32, or empty");
}

// y (M, N) = x (M, K) times int8 codes (N, K) with scales per 32 or 16 and mins per 32 or none.
void q8_into(const float* x, int64_t M, const torch::Tensor& codes, const torch::Tensor& scales,
             const torch::Tensor& mins, float* y) {
  const int64_t N = codes.size(0), K = codes.size(1);
  const Quantized xq = quantize(x, M, K);
  const Q8Weights w{codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                    mins.numel() > 0 ? mins.data_ptr<float>() : nullptr,
                    scales.size(1) == 2 * (K / QK)};
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    q8_rows(w, xq.q.data(), xq.d.data(), xq.s.data(), M, N, K, n0, n1, y);
  });
}

// A product of the layer calls below: 4-bit codes (uint8, q4) or int8 codes (q8), told apart
// by the codes' dtype, so a GGUF's int8 linears (Q5, Q6, Q8 types) take the one-call path too.
void check_product(const torch::Tensor& codes, const torch::Tensor& scales,
                   const torch::Tensor& mins, int64_t K) {
  if (codes.scalar_type() == torch::kUInt8) {
    check_q4(codes, scales, mins, K);
  } else {
    check_q8(codes, scales, mins, K);
  }
}

void product_into(const float* x, int64_t M, const torch::Tensor& codes,
                  const torch::Tensor& scales, const torch::Tensor& mins, float* y) {
  if (codes.scalar_type() == torch::kUInt8) {
    q4_into(x, M, codes, scales, mins, y);
  } else {
    q8_into(x, M, codes, scales, mins, y);
  }
}

}  // namespace

// x (M, K) float32; codes (N, K/2) uint8; scales, mins (N, K/32) float32, mins empty for
// w = (q - 8) scale -> (M, N) float32.
torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                        torch::Tensor mins) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  x = x.contiguous();
  check_x(x, K);
  check_q4(codes, scales, mins, K);
  auto y = torch::empty({x.size(0), N}, x.options());
  q4_into(x.data_ptr<float>(), x.size(0), codes, scales, mins, y.data_ptr<float>());
  return y;
}

// x (M, K) float32; codes (N, K) int8; scales (N, K/32) or (N, K/16) float32; mins (N, K/32)
// float32, or empty for none -> (M, N) float32.
torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                        torch::Tensor mins) {
  const int64_t N = codes.size(0), K = codes.size(1);
  x = x.contiguous();
  check_x(x, K);
  check_q8(codes, scales, mins, K);
  auto y = torch::empty({x.size(0), N}, x.options());
  q8_into(x.data_ptr<float>(), x.size(0), codes, scales, mins, y.data_ptr<float>());
  return y;
}

// The decode layer's work before attention, for rows x (M, K) of the residual stream:
// RMSNorm (weight norm_w), the fused q|k|v product (4-bit or int8 codes), and rotary on the first
// `rotated` columns, head by head: y*cos + roll(y, d/2)*sin, sin signed (-sin | +sin) and
// cos (M, d) per row. -> (M, N) float32.
torch::Tensor pre_attention(torch::Tensor x, torch::Tensor norm_w, double eps, torch::Tensor codes,
                            torch::Tensor scales, torch::Tensor mins, torch::Tensor cos,
                            torch::Tensor sin, int64_t rotated) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), d = cos.size(1);
  check_x(x, K);
  check_product(codes, scales, mins, K);
  TORCH_CHECK(x.is_contiguous() && norm_w.is_contiguous() && norm_w.numel() == K, "x, norm_w");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == M &&
                  sin.sizes() == cos.sizes() && d % 2 == 0 && rotated % d == 0 && rotated <= N,
              "cos, sin: (M, d); rotated: whole heads");
  std::vector<float> normed(M * K);
  rms_rows(x.data_ptr<float>(), norm_w.data_ptr<float>(), static_cast<float>(eps), M, K,
           normed.data());
  auto y = torch::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  product_into(normed.data(), M, codes, scales, mins, out);
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t half = d / 2;
  std::vector<float> head(d);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t h = 0; h < rotated / d; ++h) {
      float* v = out + r * N + h * d;
      std::copy(v, v + d, head.begin());
      for (int64_t i = 0; i < d; ++i)
        v[i] = head[i] * cp[r * d + i] + head[(i + half) % d] * sp[r * d + i];
    }
  }
  return y;
}

// The decode layer's work after attention: x + o(attn), then + down(silu(gate) * up) of its
// RMSNorm (weight norm_w) with gate|up fused (gate first). Each product from 4-bit or int8
// codes (check_product).
// x (M, K), attn (M, heads * d) -> the layer's output (M, K) float32.
torch::Tensor post_attention(torch::Tensor x, torch::Tensor attn, torch::Tensor o_codes,
                             torch::Tensor o_scales, torch::Tensor o_mins, torch::Tensor norm_w,
                             double eps, torch::Tensor gu_codes, torch::Tensor gu_scales,
                             torch::Tensor gu_mins, torch::Tensor down_codes,
                             torch::Tensor down_scales, torch::Tensor down_mins) {
  const int64_t M = x.size(0), K = x.size(1), A = attn.size(1), I = gu_codes.size(0) / 2;
  check_x(x, K);
  attn = attn.contiguous();
  check_x(attn, A);
  check_product(o_codes, o_scales, o_mins, A);
  check_product(gu_codes, gu_scales, gu_mins, K);
  check_product(down_codes, down_scales, down_mins, I);
  TORCH_CHECK(x.is_contiguous() && norm_w.is_contiguous() && norm_w.numel() == K &&
                  o_codes.size(0) == K && down_codes.size(0) == K && attn.size(0) == M,
              "post_attention: shapes do not match");
  auto y = torch::empty({M, K}, x.options());
  float* out = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  product_into(attn.data_ptr<float>(), M, o_codes, o_scales, o_mins, out);
  for (int64_t i = 0; i < M * K; ++i) out[i] += xp[i];  // x + o(attn)
  std::vector<float> normed(M * K), gu(M * 2 * I), hidden(M * I), down(M * K);
  rms_rows(out, norm_w.data_ptr<float>(), static_cast<float>(eps), M, K, normed.data());
  product_into(normed.data(), M, gu_codes, gu_scales, gu_mins, gu.data());
  for (int64_t r = 0; r < M; ++r) {
    const float *g = gu.data() + r * 2 * I, *u = g + I;
    for (int64_t i = 0; i < I; ++i) hidden[r * I + i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
  product_into(hidden.data(), M, down_codes, down_scales, down_mins, down.data());
  for (int64_t i = 0; i < M * K; ++i) out[i] += down[i];
  return y;
}

#ifndef LONGSERVE_NO_MODULE  // plain_step.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pre_attention", &pre_attention, "RMSNorm, q|k|v from 4-bit or int8 codes, rotary (CPU)");
  m.def("post_attention", &post_attention, "o, residual, RMSNorm, gated MLP from 4-bit or int8 codes");
  m.def("q4_matmul", &q4_matmul, "4-bit block codes times float rows (CPU)");
  m.def("q8_matmul", &q8_matmul, "int8 block codes times float rows (CPU)");
}
#endif

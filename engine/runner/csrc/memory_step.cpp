// memory_step: what one decode token of a memory frame computes before it attends, in one call
// each instead of dozens of small torch ops a layer (engine/memory/step_cache.py, segments.py):
//
//   step_queries  the model's rotated query and key -> the pre-rotary query and key, and both
//                 rotated at the token's window position, from the frame's rotary table
//   block_queries the pre-rotary query rotated once per retrieved block (its distance to the
//                 block's block-local keys)
//   whole_blocks  whether a retrieval's rows are whole memory blocks (read by block)
//   gather_rotated memory rows gathered and rotated at their frame slots (a retrieval of
//                 single rows: tokens, neurocache), widened to float32
//   block_scores  segments' scores of one token's query against the block summaries: the
//                 softmax over blocks of each query head, averaged over the heads of a KV group
//   consensus_step segments' whole consensus choice of one token's layer: its block scores
//                 summed into the forward's running sum, ranked with the carry, top k with
//                 their neighbours (a dozen torch ops and a Python set a layer otherwise)
//
// The rotary table is the frame's (engine/memory/rotary.py): cos and sin rows with the sign of
// rotate_half folded into sin's first half, so x rotated is x*cos + swap_halves(x)*sin, and
// undone is (x*cos - swap_halves(x)*sin) / scale_sq.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kMaxDim = 512;  // head_dim bound for the summaries' widening buffers

// out (d) = x rotated by table row p (sign +1) or undone (sign -1, divided by scale_sq)
void rotate_row(const float* x, const float* cos, const float* sin, int64_t d, float sign,
                float inv, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float swapped = i < half ? x[i + half] : x[i - half];
    out[i] = (x[i] * cos[i] + sign * swapped * sin[i]) * inv;
  }
}

void check_table(const torch::Tensor& cos, const torch::Tensor& sin, int64_t d) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(1) == d && d % 2 == 0,
              "memory_step: rotary table cos/sin (positions, head_dim) float32 contiguous");
}

void check_position(int64_t p, const torch::Tensor& cos) {
  TORCH_CHECK(p >= 0 && p < cos.size(0), "memory_step: position ", p, " outside the rotary table");
}

// query (H, d), key (kv_heads, d): float32 contiguous, rotated at frame position frame_pos.
// -> q_pre (kv_heads, group, d) and k_pre (kv_heads, 1, d) undone, and q_window (kv_heads, 1,
// group, d) and k_window (kv_heads, 1, d): q_pre and k_pre rotated at window_pos.
std::vector<torch::Tensor> step_queries(torch::Tensor query, torch::Tensor key, torch::Tensor cos,
                                        torch::Tensor sin, int64_t frame_pos, int64_t window_pos,
                                        double scale_sq) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  query.is_contiguous() && key.is_contiguous() && query.dim() == 2 &&
                  key.dim() == 2 && key.size(1) == query.size(1) && key.size(0) > 0 &&
                  query.size(0) % key.size(0) == 0,
              "step_queries: query (H, d) and key (kv_heads, d), float32 contiguous");
  const int64_t heads = query.size(0), kvh = key.size(0), group = heads / kvh, d = query.size(1);
  check_table(cos, sin, d);
  check_position(frame_pos, cos);
  check_position(window_pos, cos);
  auto q_pre = torch::empty({kvh, group, d}, query.options());
  auto k_pre = torch::empty({kvh, 1, d}, query.options());
  auto q_window = torch::empty({kvh, 1, group, d}, query.options());
  auto k_window = torch::empty({kvh, 1, d}, query.options());
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  const float inv = static_cast<float>(1.0 / scale_sq);
  const float *qp = query.data_ptr<float>(), *kp = key.data_ptr<float>();
  float *pre = q_pre.data_ptr<float>(), *win = q_window.data_ptr<float>();
  for (int64_t h = 0; h < heads; ++h) {
    rotate_row(qp + h * d, c + frame_pos * d, s + frame_pos * d, d, -1.f, inv, pre + h * d);
    rotate_row(pre + h * d, c + window_pos * d, s + window_pos * d, d, 1.f, 1.f, win + h * d);
  }
  for (int64_t h = 0; h < kvh; ++h) {
    float* kh = k_pre.data_ptr<float>() + h * d;
    rotate_row(kp + h * d, c + frame_pos * d, s + frame_pos * d, d, -1.f, inv, kh);
    rotate_row(kh, c + window_pos * d, s + window_pos * d, d, 1.f, 1.f,
               k_window.data_ptr<float>() + h * d);
  }
  return {q_pre, k_pre, q_window, k_window};
}

// q_pre (kv_heads, group, d) contiguous -> (kv_heads, nb, group, d): block j's rows rotated at
// distance - j * block (the query's distance to block-local keys, block j of nb retrieved).
torch::Tensor block_queries(torch::Tensor q_pre, torch::Tensor cos, torch::Tensor sin,
                            int64_t distance, int64_t nb, int64_t block) {
  TORCH_CHECK(q_pre.scalar_type() == at::kFloat && q_pre.is_contiguous() && q_pre.dim() == 3,
              "block_queries: q_pre (kv_heads, group, d) float32 contiguous");
  const int64_t kvh = q_pre.size(0), group = q_pre.size(1), d = q_pre.size(2);
  check_table(cos, sin, d);
  TORCH_CHECK(nb > 0 && block > 0, "block_queries: nb > 0 blocks of block > 0 keys");
  check_position(distance, cos);
  check_position(distance - (nb - 1) * block, cos);
  auto out = torch::empty({kvh, nb, group, d}, q_pre.options());
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  const float* pre = q_pre.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < kvh; ++h) {
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t p = distance - j * block;
      for (int64_t g = 0; g < group; ++g) {
        rotate_row(pre + (h * group + g) * d, c + p * d, s + p * d, d, 1.f, 1.f,
                   op + ((h * nb + j) * group + g) * d);
      }
    }
  }
  return out;
}

void check_summaries(const torch::Tensor& q_pre, const torch::Tensor& high,
                     const torch::Tensor& low) {
  const auto held = high.scalar_type();
  TORCH_CHECK(q_pre.scalar_type() == at::kFloat && (held == at::kFloat || held == at::kHalf) &&
                  q_pre.is_contiguous() && q_pre.dim() == 3 && high.dim() == 3 &&
                  high.size(0) == q_pre.size(0) && high.size(2) == q_pre.size(2) &&
                  high.stride(2) == 1 && q_pre.size(2) <= kMaxDim,
              "block_scores: q_pre (kv_heads, group, d) float32, summaries (kv_heads, blocks, d) "
              "float32 or float16");
  TORCH_CHECK(low.numel() == 0 || (low.scalar_type() == held && low.sizes() == high.sizes() &&
                                   low.stride(2) == 1),
              "block_scores: low as high");
}

// a summary row as floats: in place for float32, widened into buf for float16
const float* summary_row(const float* x, int64_t, float*) { return x; }
const float* summary_row(const at::Half* x, int64_t d, float* buf) {
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

// logits (kv_heads, group, nb) of q_pre against summaries held as T (float or at::Half)
template <typename T>
void summary_logits(const torch::Tensor& q_pre, const torch::Tensor& high,
                    const torch::Tensor& low, float sc, float* lp) {
  const bool bound = low.numel() > 0;
  const int64_t kvh = q_pre.size(0), group = q_pre.size(1), d = q_pre.size(2), nb = high.size(1);
  const float* qp = q_pre.data_ptr<float>();
  // split over blocks when there are many (a 1M-token memory has 16K blocks a layer)
  at::parallel_for(0, nb, 256, [&](int64_t begin, int64_t end) {
    float hbuf[kMaxDim], lbuf[kMaxDim];
    for (int64_t h = 0; h < kvh; ++h) {
      const T* hp = high.data_ptr<T>() + h * high.stride(0);
      const T* lo = bound ? low.data_ptr<T>() + h * low.stride(0) : nullptr;
      for (int64_t b = begin; b < end; ++b) {
        const float* hb = summary_row(hp + b * high.stride(1), d, hbuf);
        const float* lb = bound ? summary_row(lo + b * low.stride(1), d, lbuf) : nullptr;
        for (int64_t g = 0; g < group; ++g) {
          const float* q = qp + (h * group + g) * d;
          float total = 0.f;
          if (bound) {
#pragma omp simd reduction(+ : total)
            for (int64_t i = 0; i < d; ++i) total += std::max(q[i] * hb[i], q[i] * lb[i]);
          } else {
#pragma omp simd reduction(+ : total)
            for (int64_t i = 0; i < d; ++i) total += q[i] * hb[i];
          }
          lp[(h * group + g) * nb + b] = total * sc;
        }
      }
    }
  });
}

// out (kv_heads, nb), zeroed: softmax over blocks of scale * logits per query head, averaged
// over the group (block_scores below); q_pre, high and low checked by check_summaries
void scores_into(const torch::Tensor& q_pre, const torch::Tensor& high, const torch::Tensor& low,
                 float sc, float* op) {
  const int64_t kvh = q_pre.size(0), group = q_pre.size(1), nb = high.size(1);
  if (nb == 0) return;
  std::vector<float> logits(kvh * group * nb);
  float* lp = logits.data();
  if (high.scalar_type() == at::kHalf) {
    summary_logits<at::Half>(q_pre, high, low, sc, lp);
  } else {
    summary_logits<float>(q_pre, high, low, sc, lp);
  }
  for (int64_t h = 0; h < kvh; ++h) {
    for (int64_t g = 0; g < group; ++g) {
      float* row = lp + (h * group + g) * nb;
      const float top = *std::max_element(row, row + nb);
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        row[b] = std::exp(row[b] - top);
        total += row[b];
      }
      const float weight = 1.f / (total * static_cast<float>(group));
      for (int64_t b = 0; b < nb; ++b) op[h * nb + b] += row[b] * weight;
    }
  }
}

// q_pre (kv_heads, group, d) contiguous; high (kv_heads, nb, d) and low (the same, or empty)
// with contiguous rows: the per-dimension key maxima and minima of each block (score "bound":
// sum_i max(q_i * high_i, q_i * low_i)), or with low empty the blocks' mean keys (score "mean":
// q . high); summaries in float32 or float16. -> (kv_heads, nb): softmax over blocks of
// scale * logits per query head, averaged over the group.
torch::Tensor block_scores(torch::Tensor q_pre, torch::Tensor high, torch::Tensor low,
                           double scale) {
  check_summaries(q_pre, high, low);
  auto out = torch::zeros({q_pre.size(0), high.size(1)}, q_pre.options());
  scores_into(q_pre, high, low, static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

// segments' consensus choice for one decode token of one layer (segments.py, select
// "consensus"), in one call: the block scores summed over the KV heads, added to `running`
// (this forward's sum over the layers before, (nb,); empty to start a new sum), ranked with
// `carry` (the last forward's whole sum, cut or zero-padded to nb; empty for none) added.
// -> (the new running sum (nb,), the top k blocks with u neighbours on each side, clamped to
// the memory, ascending without repeats, and their memory rows (kv_heads, blocks * block),
// the same for every KV head). Ties rank the lower block first.
std::tuple<torch::Tensor, std::vector<int64_t>, torch::Tensor> consensus_step(
    torch::Tensor q_pre, torch::Tensor high, torch::Tensor low, double scale,
    torch::Tensor running, torch::Tensor carry, int64_t k, int64_t u, int64_t block) {
  check_summaries(q_pre, high, low);
  const int64_t kvh = q_pre.size(0), nb = high.size(1);
  TORCH_CHECK(k > 0 && u >= 0 && nb > 0 && block > 0,
              "consensus_step: k > 0, u >= 0, block > 0 and some blocks");
  for (const auto* t : {&running, &carry}) {
    TORCH_CHECK(t->numel() == 0 || (t->scalar_type() == at::kFloat && t->dim() == 1 &&
                                    t->is_contiguous()),
                "consensus_step: running and carry (blocks,) float32 contiguous, or empty");
  }
  TORCH_CHECK(running.numel() == 0 || running.size(0) == nb,
              "consensus_step: running has one score per block");
  std::vector<float> per_head(kvh * nb, 0.f);
  scores_into(q_pre, high, low, static_cast<float>(scale), per_head.data());
  auto total = torch::empty({nb}, q_pre.options());
  float* tp = total.data_ptr<float>();
  const float* before = running.numel() ? running.data_ptr<float>() : nullptr;
  for (int64_t b = 0; b < nb; ++b) {
    float sum = per_head[b];  // over the KV heads in order, as torch's sum over dim 0
    for (int64_t h = 1; h < kvh; ++h) sum += per_head[h * nb + b];
    tp[b] = before ? before[b] + sum : sum;
  }
  std::vector<float> rank(tp, tp + nb);
  if (carry.numel()) {
    const float* cp = carry.data_ptr<float>();
    for (int64_t b = 0; b < std::min(nb, carry.size(0)); ++b) rank[b] += cp[b];
  }
  std::vector<int64_t> order(nb);
  for (int64_t b = 0; b < nb; ++b) order[b] = b;
  const int64_t top = std::min(k, nb);
  std::partial_sort(order.begin(), order.begin() + top, order.end(), [&](int64_t a, int64_t b) {
    return rank[a] > rank[b] || (rank[a] == rank[b] && a < b);
  });
  std::vector<char> chosen(nb, 0);
  for (int64_t i = 0; i < top; ++i) {
    for (int64_t o = -u; o <= u; ++o) {
      chosen[std::min(std::max(order[i] + o, int64_t{0}), nb - 1)] = 1;
    }
  }
  std::vector<int64_t> blocks;
  for (int64_t b = 0; b < nb; ++b) {
    if (chosen[b]) blocks.push_back(b);
  }
  const int64_t width = static_cast<int64_t>(blocks.size()) * block;
  auto rows = torch::empty({kvh, width}, q_pre.options().dtype(at::kLong));
  int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t h = 0; h < kvh; ++h) {
    int64_t* out = rp + h * width;
    for (const int64_t b : blocks) {
      for (int64_t j = 0; j < block; ++j) *out++ = b * block + j;
    }
  }
  return {total, blocks, rows};
}

// Memory rows gathered and rotated at their frame slots, as RowReader.take_rotated does (engine/memory/retrieval.py)
// with a dozen torch ops: keys and values (kv_heads, n, d) float32 or float16 with contiguous
// rows (a memory buffer's view), rows (kv_heads, R) int64 in range, positions (kv_heads, R)
// int64 rows of the rotary table -> keys rotated and values, (kv_heads, R, d) float32 each.
std::vector<torch::Tensor> gather_rotated(torch::Tensor keys, torch::Tensor values,
                                          torch::Tensor rows, torch::Tensor positions,
                                          torch::Tensor cos, torch::Tensor sin) {
  const auto held = keys.scalar_type();
  TORCH_CHECK((held == at::kFloat || held == at::kHalf) && values.scalar_type() == held &&
                  keys.dim() == 3 && values.sizes() == keys.sizes() && keys.stride(2) == 1 &&
                  values.stride(2) == 1,
              "gather_rotated: keys and values (kv_heads, n, d) float32 or float16");
  TORCH_CHECK(rows.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  rows.is_contiguous() && positions.is_contiguous() && rows.dim() == 2 &&
                  rows.sizes() == positions.sizes() && rows.size(0) == keys.size(0),
              "gather_rotated: rows and positions (kv_heads, R) int64 contiguous");
  const int64_t kvh = keys.size(0), n = keys.size(1), d = keys.size(2), width = rows.size(1);
  check_table(cos, sin, d);
  TORCH_CHECK(d <= kMaxDim, "gather_rotated: head_dim above ", kMaxDim);
  auto out_k = torch::empty({kvh, width, d}, cos.options());
  auto out_v = torch::empty({kvh, width, d}, cos.options());
  const int64_t *rp = rows.data_ptr<int64_t>(), *pp = positions.data_ptr<int64_t>();
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  const int64_t half = d / 2;
  for (int64_t j = 0; j < kvh * width; ++j) {  // checked before the threads start
    TORCH_CHECK(rp[j] >= 0 && rp[j] < n, "gather_rotated: row ", rp[j], " outside the memory");
    check_position(pp[j] < 0 ? -pp[j] : pp[j], cos);
  }
  const int64_t item = held == at::kHalf ? 2 : 4;
  // rows are scattered over the memory: each one's key and value are fetched a few rows ahead
  at::parallel_for(0, kvh * width, 64, [&](int64_t begin, int64_t end) {
    float kbuf[kMaxDim];
    constexpr int64_t kAhead = 8;
    for (int64_t at = begin; at < end; ++at) {
      const int64_t h = at / width;
      if (at + kAhead < end) {
        const int64_t ah = (at + kAhead) / width, ahead = rp[at + kAhead];
        const char* nk = static_cast<const char*>(keys.data_ptr()) +
                         (ah * keys.stride(0) + ahead * keys.stride(1)) * item;
        const char* nv = static_cast<const char*>(values.data_ptr()) +
                         (ah * values.stride(0) + ahead * values.stride(1)) * item;
        for (int64_t b = 0; b < d * item; b += 64) {
          __builtin_prefetch(nk + b);
          __builtin_prefetch(nv + b);
        }
      }
      const int64_t row = rp[at];
      // a negative slot (only with fewer sinks than a block) rotates backwards: cos(p), -sin(p)
      const int64_t slot = pp[at], p = slot < 0 ? -slot : slot;
      const float sign = slot < 0 ? -1.0f : 1.0f;
      float* ok = out_k.data_ptr<float>() + at * d;
      float* ov = out_v.data_ptr<float>() + at * d;
      const float* k;
      if (held == at::kHalf) {
        k = summary_row(keys.data_ptr<at::Half>() + h * keys.stride(0) + row * keys.stride(1), d,
                        kbuf);
        summary_row(values.data_ptr<at::Half>() + h * values.stride(0) + row * values.stride(1),
                    d, ov);
      } else {
        k = keys.data_ptr<float>() + h * keys.stride(0) + row * keys.stride(1);
        const float* v = values.data_ptr<float>() + h * values.stride(0) + row * values.stride(1);
        std::copy(v, v + d, ov);
      }
      const float *cp = c + p * d, *sp = s + p * d;
      for (int64_t i = 0; i < d; ++i) {
        const float swapped = i < half ? k[i + half] : k[i - half];
        ok[i] = k[i] * cp[i] + sign * swapped * sp[i];
      }
    }
  });
  return {out_k, out_v};
}

// idx (kv_heads, R) int64 contiguous memory rows, -1 for padding -> (whole, padded): whether
// every run of `block` slots holds one whole memory block in order (padding aside), and whether
// any slot is padding.
std::tuple<bool, bool> whole_blocks(torch::Tensor idx, int64_t block) {
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous() && idx.dim() == 2 &&
                  block > 0,
              "whole_blocks: idx (kv_heads, R) int64 contiguous");
  const int64_t* p = idx.data_ptr<int64_t>();
  const int64_t n = idx.numel(), width = idx.size(1);
  bool whole = width % block == 0, padded = false;
  for (int64_t at = 0; at < n; at += block) {
    const int64_t first = p[at];
    const bool aligned = first % block == 0;  // once per run: a division per row took 28 us
    for (int64_t j = 0; j < block && at + j < n; ++j) {
      const int64_t row = p[at + j];
      if (row < 0) {
        padded = true;
      } else if (row - first != j || !aligned) {
        whole = false;
      }
    }
  }
  return {whole, padded};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("step_queries", &step_queries, "a memory decode step's queries (float32, CPU)");
  m.def("block_queries", &block_queries, "a query rotated per retrieved block (float32, CPU)");
  m.def("whole_blocks", &whole_blocks, "whether memory rows are whole blocks, and padded");
  m.def("gather_rotated", &gather_rotated, "memory rows gathered and rotated (CPU)");
  m.def("block_scores", &block_scores, "segments' block scores of one token (float32, CPU)");
  m.def("consensus_step", &consensus_step, "segments' consensus blocks of one token (float32, CPU)");
}

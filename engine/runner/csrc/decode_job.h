// DecodeJob: one decode token over a plain KV cache, split along the keys, and decode_attention,
// the Python entry that runs one. Included by decode_attention.cpp inside its namespace, after
// the helpers and run_jobs it uses (plain_step.cpp runs many DecodeJobs in one region).
#pragma once

// One decode token's attention over a KV cache: q (kv_heads, group, d) contiguous float32; keys
// and values (kv_heads, S, d) at k and v, head h's at h * ks and h * vs, rows contiguous, float32
// or float16 (a float16 KV cache: each row widened as it is read); the keys split into `splits`
// chunks per kv head (each a multiple of kBlock keys but the last), each chunk an online softmax
// into acc (heads, splits, group, d), maxes and sums (heads, splits, group), merged by their
// log-sum-exp into (kv_heads, group, d). A task runs `per_task` consecutive chunks of one head
// (group_chunks): the result depends on the chunks, never on how tasks group them.
// Raw pointers and buffers kept across calls (`set`), so that plain_step.cpp's every row and
// layer costs no tensor ops (they were ~40 % of an 8-row step on a short cache: decision 091).
struct DecodeJob {
  const float* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  bool half = false;
  int64_t ks = 0, vs = 0, heads = 0, keys = 0, d = 0, group = 0, splits = 0, chunk = 0;
  int64_t per_task = 1;
  float sc = 0.f;
  std::vector<float> acc, maxes, sums;

  void set(const float* q_, const void* k_, const void* v_, bool half_, int64_t ks_, int64_t vs_,
           int64_t heads_, int64_t keys_, int64_t d_, int64_t group_, float scale,
           int64_t splits_) {
    q = q_, k = k_, v = v_, half = half_, ks = ks_, vs = vs_, heads = heads_, keys = keys_, d = d_;
    group = group_, sc = scale;
    splits = std::max<int64_t>(1, std::min(splits_, keys));
    chunk = ((keys + splits - 1) / splits + kBlock - 1) / kBlock * kBlock;
    splits = (keys + chunk - 1) / chunk;
    per_task = 1;
    acc.assign(heads * splits * group * d, 0.f);
    maxes.assign(heads * splits * group, -FLT_MAX);
    sums.assign(heads * splits * group, 0.f);
  }

  int64_t head_tasks() const { return (splits + per_task - 1) / per_task; }
  int64_t tasks() const { return heads * head_tasks(); }

  void run(int64_t task, TaskScratch& x) {
    if (half) {
      run_typed(static_cast<const at::Half*>(k), static_cast<const at::Half*>(v), task, x);
    } else {
      run_typed(static_cast<const float*>(k), static_cast<const float*>(v), task, x);
    }
  }

  template <typename T>
  void run_typed(const T* kp, const T* vp, int64_t task, TaskScratch& x) {
    x.fit(group, d);
    const int64_t h = task / head_tasks(), c0 = (task % head_tasks()) * per_task;
    const int64_t c1 = std::min(splits, c0 + per_task);
    const int64_t last = std::min(keys, c1 * chunk);  // the task's end: prefetch runs on past chunks
    const float* qh = q + h * group * d;
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t part = h * splits + c, end = std::min(keys, (c + 1) * chunk);
      Running r(x, maxes.data() + part * group, sums.data() + part * group,
                acc.data() + part * group * d, group, d);
      run_chunk(kp, vp, h, c * chunk, end, last, qh, r.a, r.m, r.l, x);
    }
  }

  // Keys first..end of head h, online softmax into a, m, l; the task's keys run on to last
  template <typename T>
  void run_chunk(const T* kp, const T* vp, int64_t h, int64_t first, int64_t end, int64_t last,
                 const float* qh, float* a, float* m, float* l, TaskScratch& x) {
    const float* krows[kBlock];
    const float* vrows[kBlock];
    for (int64_t b0 = first; b0 < end; b0 += kBlock) {
      const int64_t n = std::min(kBlock, end - b0);
      const auto next = [b0](int64_t j) { return b0 + j; };
#ifdef LONGSERVE_PIECES_AVX512
      if (x.wide) {  // read as held, 16 lanes at a time (pieces_avx512.h), the next block's
        // rows prefetched beside this block's
        pieces512::Piece piece{kp + h * ks, vp + h * vs, d, d, nullptr, nullptr, 0, 0, 0};
        piece.ahead = b0 + 2 * kBlock <= last ? kBlock * d : 0;
        pieces512::fold_block<T>(piece, next, b0, n, qh, keys, group, d, sc, nullptr, *x.wide, m,
                                 l, a);
        continue;
      }
#endif
#ifdef LONGSERVE_PLAIN_AVX2
      if (plain256::takes(group, d)) {
        const T* kheld[kBlock];  // the block's rows where they are held
        const T* vheld[kBlock];
        for (int64_t j = 0; j < n; ++j) {
          kheld[j] = kp + h * ks + (b0 + j) * d;
          vheld[j] = vp + h * vs + (b0 + j) * d;
        }
        // the next block's rows prefetched beside this block's, as the AVX-512 path does
        const int64_t ahead = b0 + 2 * kBlock <= last ? kBlock * d : 0;
        plain256::fold_rows<T>(kheld, vheld, n, qh, group, d, sc, x.scores.data(), x.kbuf.data(),
                               m, l, a, ahead);
        continue;
      }
#endif
      if (b0 + kBlock < last) {
        const int64_t ahead = std::min(kBlock, last - b0 - kBlock);
        prefetch_rows(kp + h * ks + (b0 + kBlock) * d, ahead, d);
        prefetch_rows(vp + h * vs + (b0 + kBlock) * d, ahead, d);
      }
      row_pointers(kp + h * ks, d, n, d, x.kbuf.data(), next, krows);
      row_pointers(vp + h * vs, d, n, d, x.vbuf.data(), next, vrows);
      score_rows(qh, krows, n, group, d, sc, x.scores.data());
      fold_scores(x.scores.data(), n, group, d, m, l, a);
      accumulate(x.scores.data(), vrows, n, group, d, a);
    }
  }

  void result_into(float* out) const {
    merge_into(acc.data(), maxes.data(), sums.data(), heads, splits, group, d, out);
  }
};

constexpr int64_t kTasksPerThread = 12;  // a region's tasks: enough that threads end together

// Chunks per task for jobs run in one region: about kTasksPerThread tasks a thread, so a lone
// row keeps a task per chunk and a batch's rows stream whole heads with fewer cold starts
// (decision 093). Each row's sums stay its chunks', so its answer is the same in any batch.
void group_chunks(std::vector<DecodeJob>& jobs) {
  int64_t heads = 0;
  for (const auto& job : jobs) heads += job.heads;
  const int64_t wanted = kTasksPerThread * at::get_num_threads();
  const int64_t per_head = std::max<int64_t>(1, (wanted + heads - 1) / std::max<int64_t>(1, heads));
  for (auto& job : jobs) {
    const int64_t head_tasks = std::min(job.splits, per_head);
    job.per_task = (job.splits + head_tasks - 1) / head_tasks;
  }
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                               int64_t splits) {
  const auto kv_type = k.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && v.scalar_type() == kv_type &&
                  (kv_type == at::kFloat || kv_type == at::kHalf),
              "decode_attention: a float32 query, float32 or float16 keys and values");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.is_contiguous(),
              "decode_attention: q (kv_heads, group, d) contiguous, k/v (kv_heads, S, d)");
  const int64_t heads = k.size(0), keys = k.size(1), d = k.size(2), group = q.size(1);
  TORCH_CHECK(q.size(0) == heads && q.size(2) == d && v.sizes() == k.sizes() && keys > 0 &&
                  d <= 256,
              "decode_attention: shapes do not match (head_dim up to 256)");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == d && v.stride(1) == d,
              "decode_attention: k/v rows must be contiguous");
  std::vector<DecodeJob> jobs(1);
  jobs[0].set(q.data_ptr<float>(), k.data_ptr(), v.data_ptr(), kv_type == at::kHalf, k.stride(0),
              v.stride(0), heads, keys, d, group, static_cast<float>(scale), splits);
  group_chunks(jobs);
  run_jobs(jobs);
  auto out = torch::empty({heads, group, d}, q.options());
  jobs[0].result_into(out.data_ptr<float>());
  return out;
}

// attend_pieces: one decode token of a memory frame over the step cache's pieces under one
// softmax (engine/memory/step_cache.py), and attend_pieces_rows: several rows' at once. Included
// by decode_attention.cpp inside its namespace, after the helpers and run_jobs it uses.
#pragma once

// One decode token over several pieces of keys under one softmax (a memory frame's step:
// engine/memory/step_cache.py): queries[i] (kv_heads, nq, group, d) contiguous, keys[i] and
// values[i] (kv_heads, n, d) with contiguous rows, key j of piece i scored by its query
// j / (n / nq) (nq > 1: one query per block of keys); masks[i] (kv_heads, n) bool, or empty
// for none (a False key is left out). -> (kv_heads, group, d) float32. Queries are float32;
// a piece's keys and values float32, float16 (widened as they are read) or int8 codes (uint8,
// dequantized as they are read: key_params[i] and value_params[i] as int8_rows takes them, keys'
// per `qgroup` rows; empty tensors for other pieces). The pieces' keys,
// taken one after the other, are split into `splits` chunks per kv head, attended as tasks
// across threads and merged as decode_attention's are (3 kv heads alone leave a thread idle).
// A PiecesJob is one such call: its operands checked, its tasks' partial results, their merge.
struct PiecesJob {
  std::vector<torch::Tensor> queries, keys, values, masks, rows, key_params, value_params;
  int64_t qgroup, heads, group, d, total = 0, splits, chunk;
  std::vector<int64_t> lengths;
  float sc;
  torch::Tensor acc, maxes, sums;

  PiecesJob(std::vector<torch::Tensor> queries_, std::vector<torch::Tensor> keys_,
            std::vector<torch::Tensor> values_, std::vector<torch::Tensor> masks_,
            std::vector<torch::Tensor> rows_, std::vector<torch::Tensor> key_params_,
            std::vector<torch::Tensor> value_params_, int64_t qgroup_, double scale,
            int64_t splits_)
      : queries(std::move(queries_)), keys(std::move(keys_)), values(std::move(values_)),
        masks(std::move(masks_)), rows(std::move(rows_)), key_params(std::move(key_params_)),
        value_params(std::move(value_params_)), qgroup(qgroup_), sc(static_cast<float>(scale)) {
    const size_t pieces = queries.size();
    TORCH_CHECK(pieces > 0 && keys.size() == pieces && values.size() == pieces &&
                    masks.size() == pieces && rows.size() == pieces &&
                    key_params.size() == pieces && value_params.size() == pieces,
                "attend_pieces: as many queries, keys, values, masks, rows and params");
    heads = queries[0].size(0), group = queries[0].size(2), d = queries[0].size(3);
    lengths.resize(pieces);
    for (size_t i = 0; i < pieces; ++i) check(i);
    for (const int64_t n : lengths) total += n;
    splits = std::max<int64_t>(1, std::min(splits_, total));
    // whole blocks a task: runs of retrieved memory blocks stay block-aligned (next_offset)
    chunk = ((total + splits - 1) / splits + kBlock - 1) / kBlock * kBlock;
    splits = (total + chunk - 1) / chunk;
    const auto options = queries[0].options();
    acc = torch::zeros({heads, splits, group, d}, options);
    maxes = torch::full({heads, splits, group}, -FLT_MAX, options);
    sums = torch::zeros({heads, splits, group}, options);
  }

  void check(size_t i) {
    const auto &q = queries[i], &k = keys[i], &v = values[i], &mask = masks[i], &row = rows[i];
    TORCH_CHECK(q.scalar_type() == at::kFloat && v.scalar_type() == k.scalar_type() &&
                    (k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf ||
                     k.scalar_type() == at::kByte) &&
                    q.is_contiguous() && q.dim() == 4,
                "attend_pieces: float32 queries (kv_heads, nq, group, d) contiguous, float32, "
                "float16 or uint8 keys and values");
    if (k.scalar_type() == at::kByte) {  // int8 codes: their scales cover every row
      const auto &kp = key_params[i], &vp = value_params[i];
      TORCH_CHECK(qgroup > 0 && k.size(2) <= kMaxInt8Dim && kp.scalar_type() == at::kHalf &&
                      vp.scalar_type() == at::kHalf && kp.dim() == 3 && vp.dim() == 3 &&
                      kp.size(0) == k.size(0) && vp.size(0) == k.size(0) &&
                      kp.size(2) == 2 * k.size(2) && vp.size(2) == 2 && kp.stride(2) == 1 &&
                      vp.stride(2) == 1 && kp.size(1) * qgroup >= k.size(1) &&
                      vp.size(1) >= k.size(1),
                  "attend_pieces: int8 keys need float16 params (kv_heads, n / group, 2d) and "
                  "values (kv_heads, n, 2)");
    }
    TORCH_CHECK(row.numel() == 0 || (row.scalar_type() == at::kLong && row.is_contiguous() &&
                                     row.dim() == 2 && row.size(0) == heads),
                "attend_pieces: rows (kv_heads, n) int64");
    if (row.numel()) {  // the keys are read in place: every row index within k
      const int64_t* r = row.data_ptr<int64_t>();
      bool inside = true;
      for (int64_t j = 0; j < row.numel(); ++j) inside &= r[j] >= 0 && r[j] < k.size(1);
      TORCH_CHECK(inside, "attend_pieces: a row index outside the keys");
    }
    lengths[i] = row.numel() ? row.size(1) : k.size(1);
    TORCH_CHECK(q.size(0) == heads && q.size(2) == group && q.size(3) == d && k.dim() == 3 &&
                    k.size(0) == heads && k.size(2) == d && v.sizes() == k.sizes() &&
                    lengths[i] % q.size(1) == 0,
                "attend_pieces: shapes do not match");
    TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "attend_pieces: k/v rows contiguous");
    TORCH_CHECK(mask.numel() == 0 || (mask.scalar_type() == at::kBool && mask.is_contiguous() &&
                                      mask.size(0) == heads && mask.size(1) == lengths[i]),
                "attend_pieces: masks (kv_heads, n) bool");
  }

  int64_t tasks() const { return heads * splits; }

  // Rows from the block at b0 to the next whole block of the task's run (up to hi), when each
  // of that block's rows is this one's row plus the same offset (contiguous rows, or memory
  // blocks retrieved in the order they are held); else 0, nothing to prefetch. at: the
  // piece's row of each key, or null for rows in order.
  static int64_t next_offset(const int64_t* at, int64_t b0, int64_t hi) {
    if (b0 + 2 * kBlock > hi) return 0;
    if (at == nullptr) return kBlock;
    const int64_t offset = at[b0 + kBlock] - at[b0];
    for (int64_t j = 1; j < kBlock; ++j) {
      if (at[b0 + kBlock + j] - at[b0 + j] != offset) return 0;
    }
    return offset;
  }

  // Task `task` (a kv head's chunk of the pieces' keys) into its slot of acc, maxes and sums
  void run(int64_t task, TaskScratch& x) {
    x.fit(group, d);
    const float* krows[kBlock];
    const float* vrows[kBlock];
    const int64_t h = task / splits, first = (task % splits) * chunk;
    const int64_t last = std::min(total, first + chunk);
    Running r(x, maxes.data_ptr<float>() + task * group, sums.data_ptr<float>() + task * group,
              acc.data_ptr<float>() + task * group * d, group, d);
    float *a = r.a, *m = r.m, *l = r.l;
    int64_t offset = 0;  // of piece i in the pieces' keys taken one after the other
    for (size_t i = 0; i < queries.size(); offset += lengths[i], ++i) {
      const int64_t n = lengths[i];
      const int64_t lo = std::max<int64_t>(0, first - offset), hi = std::min(n, last - offset);
      if (lo >= hi) continue;
      const auto &q = queries[i], &k = keys[i], &v = values[i], &mask = masks[i];
      const int64_t nq = q.size(1), per = n / nq;
      const float* qp = q.data_ptr<float>() + h * nq * group * d;
      const bool* ok = mask.numel() ? mask.data_ptr<bool>() + h * n : nullptr;
      const int64_t* at = rows[i].numel() ? rows[i].data_ptr<int64_t>() + h * n : nullptr;
#ifdef LONGSERVE_PIECES_AVX512
      const auto type = k.scalar_type();
      const auto &kp = key_params[i], &vp = value_params[i];
      pieces512::Piece piece =
          !x.wide                ? pieces512::Piece{}
          : type == at::kByte    ? pieces512::piece<uint8_t>(k, v, kp, vp, qgroup, h)
          : type == at::kHalf    ? pieces512::piece<at::Half>(k, v, kp, vp, 0, h)
                                 : pieces512::piece<float>(k, v, kp, vp, 0, h);
#endif
      for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
        const int64_t count = std::min(kBlock, hi - b0);
        const auto index = [at, b0](int64_t j) { return at ? at[b0 + j] : b0 + j; };
        // the next block's rows prefetched beside this block's, where k and v step alike
        const int64_t ahead = k.stride(1) == v.stride(1) ? next_offset(at, b0, hi) * k.stride(1)
                                                         : 0;
#ifdef LONGSERVE_PIECES_AVX512
        if (x.wide) {  // read in place as held, 16 lanes at a time (pieces_avx512.h)
          piece.ahead = ahead;
          if (type == at::kByte) {
            pieces512::fold_block<uint8_t>(piece, index, b0, count, qp, per, group, d, sc, ok,
                                           *x.wide, m, l, a);
          } else if (type == at::kHalf) {
            pieces512::fold_block<at::Half>(piece, index, b0, count, qp, per, group, d, sc, ok,
                                            *x.wide, m, l, a);
          } else {
            pieces512::fold_block<float>(piece, index, b0, count, qp, per, group, d, sc, ok,
                                         *x.wide, m, l, a);
          }
          continue;
        }
#endif
#ifdef LONGSERVE_PLAIN_AVX2
        if (k.scalar_type() != at::kByte && plain256::takes(group, d)) {  // rows read as held
          if (k.scalar_type() == at::kHalf) {
            fold_held<at::Half>(k, v, h, index, b0, count, qp, per, ok, x, m, l, a, ahead);
          } else {
            fold_held<float>(k, v, h, index, b0, count, qp, per, ok, x, m, l, a, ahead);
          }
          continue;
        }
#endif
        if (k.scalar_type() == at::kByte) {
          int8_rows(k, key_params[i], qgroup, h, count, d, x.kbuf.data(), index, krows);
          int8_rows(v, value_params[i], 0, h, count, d, x.vbuf.data(), index, vrows);
        } else {
          piece_rows(k, h, count, d, x.kbuf.data(), index, krows);
          piece_rows(v, h, count, d, x.vbuf.data(), index, vrows);
        }
        for (int64_t j0 = 0; j0 < count;) {  // runs of keys that share a query
          const int64_t qi = (b0 + j0) / per;
          const int64_t j1 = std::min(count, (qi + 1) * per - b0);
          score_rows(qp + qi * group * d, krows + j0, j1 - j0, group, d, sc,
                     x.scores.data() + j0);
          j0 = j1;
        }
        mask_out(x.scores.data(), ok, b0, count, group);
        fold_scores(x.scores.data(), count, group, d, m, l, a);
        accumulate(x.scores.data(), vrows, count, group, d, a);
      }
    }
  }

#ifdef LONGSERVE_PLAIN_AVX2
  // The `count` rows of head h's float16 or float32 piece from b0 (index(j): key j's row)
  // folded into (m, l, a), read where they are held, once for the query group (plain_avx2.h);
  // queries qp (nq, group, d), one per `per` keys; keys left out where ok is false
  template <typename T, typename F>
  void fold_held(const torch::Tensor& k, const torch::Tensor& v, int64_t h, F index, int64_t b0,
                 int64_t count, const float* qp, int64_t per, const bool* ok, TaskScratch& x,
                 float* m, float* l, float* a, int64_t ahead) const {
    const T* kh = k.data_ptr<T>() + h * k.stride(0);
    const T* vh = v.data_ptr<T>() + h * v.stride(0);
    const T* krows[kBlock];
    const T* vrows[kBlock];
    for (int64_t j = 0; j < count; ++j) {
      krows[j] = kh + index(j) * k.stride(1);
      vrows[j] = vh + index(j) * v.stride(1);
    }
    float* scores = x.scores.data();
    for (int64_t j0 = 0; j0 < count;) {  // runs of keys that share a query
      const int64_t qi = (b0 + j0) / per;
      const int64_t j1 = std::min(count, (qi + 1) * per - b0);
      plain256::score<T>(qp + qi * group * d, krows + j0, j1 - j0, group, d, sc, scores + j0,
                         x.kbuf.data(), ahead);
      j0 = j1;
    }
    mask_out(scores, ok, b0, count, group);
    fold_scores(scores, count, group, d, m, l, a);
    plain256::accumulate<T>(scores, vrows, count, group, d, a, ahead);
  }
#endif

  torch::Tensor result() const { return merge_splits(acc, maxes, sums); }
};

torch::Tensor attend_pieces(std::vector<torch::Tensor> queries, std::vector<torch::Tensor> keys,
                            std::vector<torch::Tensor> values, std::vector<torch::Tensor> masks,
                            std::vector<torch::Tensor> rows, std::vector<torch::Tensor> key_params,
                            std::vector<torch::Tensor> value_params, int64_t qgroup, double scale,
                            int64_t splits) {
  std::vector<PiecesJob> jobs;
  jobs.emplace_back(std::move(queries), std::move(keys), std::move(values), std::move(masks),
                    std::move(rows), std::move(key_params), std::move(value_params), qgroup,
                    scale, splits);
  run_jobs(jobs);
  return jobs[0].result();
}

// attend_pieces for several decode rows in one parallel region (a batched step's layer): the
// r-th of each list is row r's argument; each row's result as attend_pieces would give it.
std::vector<torch::Tensor> attend_pieces_rows(
    std::vector<std::vector<torch::Tensor>> queries, std::vector<std::vector<torch::Tensor>> keys,
    std::vector<std::vector<torch::Tensor>> values, std::vector<std::vector<torch::Tensor>> masks,
    std::vector<std::vector<torch::Tensor>> rows,
    std::vector<std::vector<torch::Tensor>> key_params,
    std::vector<std::vector<torch::Tensor>> value_params, std::vector<int64_t> qgroups,
    std::vector<double> scales, std::vector<int64_t> splits) {
  const size_t n = queries.size();
  TORCH_CHECK(keys.size() == n && values.size() == n && masks.size() == n && rows.size() == n &&
                  key_params.size() == n && value_params.size() == n && qgroups.size() == n &&
                  scales.size() == n && splits.size() == n,
              "attend_pieces_rows: as many of each argument as rows");
  std::vector<PiecesJob> jobs;
  jobs.reserve(n);
  for (size_t r = 0; r < n; ++r) {
    jobs.emplace_back(std::move(queries[r]), std::move(keys[r]), std::move(values[r]),
                      std::move(masks[r]), std::move(rows[r]), std::move(key_params[r]),
                      std::move(value_params[r]), qgroups[r], scales[r], splits[r]);
  }
  run_jobs(jobs);
  std::vector<torch::Tensor> out;
  for (const auto& job : jobs) out.push_back(job.result());
  return out;
}

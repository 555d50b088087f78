// Training rows: jsonl {"input_ids": [...], "loss_mask": [...]}, as mesp/ondevice/runner.py
// read_rows() and make_batch() define them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mesp {

struct Row {
  std::vector<int64_t> ids;
  std::vector<uint8_t> mask;  // mask[t] = 1 trains token t; mask[0] is always 0
};

// All rows of `path`; throws RunnerError "FILE:LINE: why" for a bad row, "FILE: no rows".
std::vector<Row> read_rows(const std::string& path, int64_t seq_len, int64_t vocab);

// One batch of B rows right-padded to S: input ids, targets and the trained positions.
struct Batch {
  std::vector<int64_t> ids;   // (B, S)
  std::vector<int64_t> rows;  // flat indices r*S + t of trained positions, increasing
  std::vector<int64_t> tgt;   // target id at each of those positions
};

// Step k (1-based) uses rows ((k-1)*B + j) % rows.size(), j = 0..B-1.
Batch make_batch(const std::vector<Row>& rows, int64_t step, int64_t batch_size, int64_t seq_len);
// One row alone in slot 0 (DP-SGD's per-example pass); slots 1..B-1 padded, nothing trained.
Batch example_batch(const Row& row, int64_t batch_size, int64_t seq_len);

}  // namespace mesp

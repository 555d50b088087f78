#include "data.h"

#include <fstream>
#include <sstream>

#include "error.h"
#include "json.h"
#include "platform.h"

namespace mesp {

static bool blank(const std::string& s) {
  for (char c : s)
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n' && c != '\f' && c != '\v') return false;
  return true;
}

std::vector<Row> read_rows(const std::string& path, int64_t seq_len, int64_t vocab) {
  if (file_size(path) < 0)
    throw RunnerError(path + ": unreadable (No such file or not a regular file)");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw RunnerError(path + ": unreadable");
  std::vector<Row> rows;
  std::string line;
  const std::string ids_msg =
      "\"input_ids\" must be a list of token ids in 0.." + std::to_string(vocab - 1);
  for (size_t n = 1; std::getline(f, line); ++n) {
    if (blank(line)) continue;
    const std::string where = path + ":" + std::to_string(n);
    Json j;
    std::string why;
    if (!Json::parse(line, j, why)) throw RunnerError(where + ": not JSON (" + why + ")");
    const Json* ids = j.find("input_ids");
    if (ids == nullptr || !ids->is_array()) throw RunnerError(where + ": " + ids_msg);
    Row r;
    for (const Json& x : ids->items()) {
      if (!x.is_int() || x.as_int() < 0 || x.as_int() >= vocab)
        throw RunnerError(where + ": " + ids_msg);
      r.ids.push_back(x.as_int());
    }
    const int64_t len = static_cast<int64_t>(r.ids.size());
    if (len < 2 || len > seq_len + 1)
      throw RunnerError(where + ": " + std::to_string(len) + " tokens; rows must have 2.." +
                        std::to_string(seq_len + 1) + " (the exported sequence length " +
                        std::to_string(seq_len) + ", plus one)");
    r.mask.assign(r.ids.size(), 1);
    if (const Json* m = j.find("loss_mask")) {
      const std::string mask_msg = "\"loss_mask\" must be a list of 0/1, one per token";
      if (!m->is_array() || m->items().size() != r.ids.size())
        throw RunnerError(where + ": " + mask_msg);
      for (size_t t = 0; t < r.ids.size(); ++t) {
        const Json& x = m->items()[t];
        // Python's `x in (0, 1)` also admits true/false and 0.0/1.0.
        if (x.is_bool()) {
          r.mask[t] = x.as_bool() ? 1 : 0;
        } else if (x.is_number() && (x.as_double() == 0.0 || x.as_double() == 1.0)) {
          r.mask[t] = x.as_double() == 1.0 ? 1 : 0;
        } else {
          throw RunnerError(where + ": " + mask_msg);
        }
      }
    }
    r.mask[0] = 0;  // token 0 has nothing before it to be predicted from
    rows.push_back(std::move(r));
  }
  if (rows.empty()) throw RunnerError(path + ": no rows");
  return rows;
}

namespace {
void put_row(Batch& b, const Row& r, int64_t j, int64_t seq_len) {
  const int64_t k = static_cast<int64_t>(r.ids.size()) - 1;
  for (int64_t t = 0; t < k; ++t) {
    b.ids[j * seq_len + t] = r.ids[t];
    if (r.mask[t + 1]) {
      b.rows.push_back(j * seq_len + t);
      b.tgt.push_back(r.ids[t + 1]);
    }
  }
}
}  // namespace

Batch make_batch(const std::vector<Row>& rows, int64_t step, int64_t batch_size, int64_t seq_len) {
  Batch b;
  b.ids.assign(static_cast<size_t>(batch_size * seq_len), 0);
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t j = 0; j < batch_size; ++j)
    put_row(b, rows[static_cast<size_t>(((step - 1) * batch_size + j) % n)], j, seq_len);
  return b;
}

Batch example_batch(const Row& row, int64_t batch_size, int64_t seq_len) {
  Batch b;
  b.ids.assign(static_cast<size_t>(batch_size * seq_len), 0);
  put_row(b, row, 0, seq_len);
  return b;
}

}  // namespace mesp

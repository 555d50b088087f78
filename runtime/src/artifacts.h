// The artifact directory (`mesp export --target executorch`): run_config.json and every file it
// names, checked before any program is loaded (export id, tensor tables, .pte sizes and hashes).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "json.h"
#include "tensor.h"

namespace mesp {

struct TableEntry {  // one tensor as run_config.json's "files" table lists it
  DType dtype = DType::Unknown;
  std::string dtype_text;
  Shape shape;
};
using Table = std::map<std::string, TableEntry>;

struct IoSpec {  // one program input or output
  std::string name;
  DType dtype = DType::Unknown;
  Shape shape;  // upper bounds on the dynamic dims
  std::vector<int> dynamic_dims;
  bool is_dynamic(size_t d) const;
};

struct ProgramSpec {
  std::string name;
  std::string pte;  // relative path
  std::string method;
  uint64_t size = 0;
  std::string fnv1a64;
  std::vector<int64_t> planned_bytes;
  std::vector<IoSpec> inputs, outputs;
  const IoSpec* input(const std::string& n) const;   // nullptr when absent
  const IoSpec* output(const std::string& n) const;  // nullptr when absent
};

struct BlockInfo {
  std::string file, fn, layer_type;
};

struct Artifacts {
  std::string root;
  Json conf;
  std::string export_id;
  int64_t seq_len = 0, batch_size = 0, vocab = 0;
  std::map<std::string, Table> files;  // relative path -> its tensors
  std::vector<BlockInfo> blocks;
  std::map<std::string, ProgramSpec> programs;
  std::string lora_init;  // relative path of the initial adapter
  // executorch.loss: the head in slices of loss_chunk rows (loss_tail for a shorter last one),
  // read from head_file's tensors "<head_prefix>.weight|scales|biases"
  int64_t loss_chunk = 0;
  std::string head_file, head_prefix;

  std::string path(const std::string& rel) const { return root + "/" + rel; }
  const ProgramSpec& program(const std::string& name) const;
};

// Reads run_config.json under `root` and checks every file against it; throws RunnerError.
Artifacts load_artifacts(const std::string& root);

// FNV-1a 64 of a byte range, as 16 lowercase hex digits.
std::string fnv1a64_hex(const uint8_t* data, size_t n);

}  // namespace mesp

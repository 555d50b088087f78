// safetensors files: an 8-byte little-endian header length, a JSON header
// {"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the
// data. The header is read and checked on its own (cheap); the data is mapped only on open().
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "platform.h"
#include "tensor.h"

namespace mesp {

struct StEntry {
  std::string dtype;  // as written ("F32", ...)
  Shape shape;
  uint64_t begin = 0, end = 0;  // offsets into the data section
};

struct StHeader {
  std::map<std::string, StEntry> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + header length
  uint64_t file_size = 0;
};

// Reads and validates the header of `path` (offsets within the file, sizes matching dtype and
// shape). Throws RunnerError "<path>: ...".
StHeader read_st_header(const std::string& path);

// A safetensors file with its data in memory (mapped) for as long as the object lives.
class StFile {
 public:
  // Checks the header again (the file may have changed since the up-front check) and maps it.
  void open(const std::string& path);
  void release() { view_.release(); }
  bool is_open() const { return view_.data() != nullptr || view_.size() > 0; }
  const StHeader& header() const { return header_; }
  const std::string& path() const { return path_; }
  // Pointer to a tensor's bytes; throws if absent.
  const uint8_t* data(const std::string& name) const;
  size_t nbytes() const { return view_.size(); }

 private:
  std::string path_;
  StHeader header_;
  FileView view_;
};

// One tensor to write: name, dtype, shape, bytes.
struct StOut {
  std::string name;
  DType dtype;
  Shape shape;
  const uint8_t* data;
  size_t nbytes;
};

// A safetensors file holding `tensors` (sorted by name here) and `metadata`, as its pieces:
// `head` (the 8-byte length and the JSON header) and the tensors' own bytes, in file order.
// For write_atomic(path, parts): the file is written with no second copy of the tensors.
struct StParts {
  std::string head;
  std::vector<StOut> tensors;
  std::vector<ByteSpan> parts() const;  // head, then each tensor (valid while *this lives)
};
StParts st_layout(std::vector<StOut> tensors, const std::map<std::string, std::string>& metadata);

// The same file's bytes in one string.
std::string st_serialize(std::vector<StOut> tensors,
                         const std::map<std::string, std::string>& metadata);

}  // namespace mesp

// Every OS-specific call of the runner, behind one small interface (see platform_posix.cpp).
// A port (Windows, a sandboxed mobile app) replaces that one file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mesp {

// A read-only view of a whole file: mapped where the OS can, read into memory otherwise.
// Move-only; the view is released in the destructor (or by release()).
class FileView {
 public:
  FileView() = default;
  ~FileView() { release(); }
  FileView(FileView&& o) noexcept { *this = std::move(o); }
  FileView& operator=(FileView&& o) noexcept;
  FileView(const FileView&) = delete;
  FileView& operator=(const FileView&) = delete;

  // Opens `path`; on failure returns false and sets `why` (strerror text).
  bool open(const std::string& path, std::string& why);
  void release();
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;  // else data_ was allocated with new[]
};

// A scratch file with no name: created in `dir` and unlinked at once, so nothing is left behind,
// even after a crash. The runner writes the block checkpoints there and reads them back in the
// backward (--checkpoints-dir): they leave anonymous memory for the page cache, which the kernel
// can write back and reclaim. Move-only; closed in the destructor.
class ScratchFile {
 public:
  ScratchFile() = default;
  ~ScratchFile();
  ScratchFile(ScratchFile&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  ScratchFile& operator=(ScratchFile&& o) noexcept;
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;

  bool open(const std::string& dir, std::string& why);
  bool is_open() const { return fd_ >= 0; }
  // The whole of [p, p + n) at `offset`, or false with `why` (a full disk, an I/O error).
  bool write(uint64_t offset, const void* p, size_t n, std::string& why);
  bool read(uint64_t offset, void* p, size_t n, std::string& why) const;

 private:
  int fd_ = -1;
};

// `n` bytes of zeros that cost no memory while they are only read: an anonymous mapping whose
// pages all map the kernel's one zero page until written (calloc'd memory elsewhere). Move-only.
class ZeroPages {
 public:
  explicit ZeroPages(size_t n);
  ~ZeroPages();
  ZeroPages(const ZeroPages&) = delete;
  ZeroPages& operator=(const ZeroPages&) = delete;
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;
};

// Reads `n` bytes at `offset` (used to read a safetensors header without mapping the data).
bool read_at(const std::string& path, uint64_t offset, size_t n, std::string& out,
             std::string& why);
// Size of a regular file, or -1 (not found / not a regular file).
int64_t file_size(const std::string& path);
bool is_dir(const std::string& path);
// Whether `path` could be created or written as a directory: it is a writable directory, or
// does not exist and its nearest existing ancestor is one. False with `why` otherwise.
bool dir_writable(const std::string& path, std::string& why);
// mkdir -p; false with `why` on failure.
bool make_dirs(const std::string& path, std::string& why);
// Writes `bytes` to a temp file beside `path`, fsyncs it, renames it over `path`, fsyncs the
// directory: a crash leaves the old file or the new one, never half of one.
bool write_atomic(const std::string& path, const std::string& bytes, std::string& why);
// The same for a file made of several pieces, written in order straight from where they lie
// (no whole copy of the file in memory: the adapter's tensors are written from their buffers).
struct ByteSpan {
  const void* data = nullptr;
  size_t size = 0;
};
bool write_atomic(const std::string& path, const std::vector<ByteSpan>& parts, std::string& why);

// Memory of this process, in bytes: peak resident set (VmHWM) and current anonymous RSS;
// private_dirty (pages this process wrote, file-backed ones included: what it cannot give
// back) only from mem_detail(), which also reads /proc/self/smaps_rollup (slower: not per run).
struct MemInfo {
  uint64_t peak_rss = 0;
  uint64_t rss_anon = 0;
  uint64_t private_dirty = 0;
};
MemInfo mem_info();
MemInfo mem_detail();

// A thread that reads this process's anonymous RSS (/proc/self/statm: resident − shared pages,
// the kernel's RssAnon) every `period_us` microseconds and keeps the largest value it saw, until
// the process exits. Samples taken between programs miss what a program allocates and frees
// inside one call (XNNPACK's packing buffers, the kernels' blocks); this sees every transient
// that lives longer than the period. period_us <= 0 starts nothing; a second call changes
// nothing. anon_watch_peak(): the largest value read so far (0 before the first read).
void start_anon_watch(int period_us);
uint64_t anon_watch_peak();
// The largest value read since the previous call (0 if none): the peak inside one program.
uint64_t anon_watch_take();

// Ctrl-C / SIGTERM: print "mesp-runner: interrupted; no adapter written" and exit 130, as the
// Python runner does (the adapter is only ever renamed into place whole).
void on_interrupt_exit();

// Seconds from a monotonic clock.
double now_seconds();

}  // namespace mesp

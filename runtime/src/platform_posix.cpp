// POSIX implementation of platform.h (Linux, Android, macOS, iOS). The only file of the runner
// that includes OS headers. /proc/self/status exists on Linux and Android only; elsewhere the
// memory numbers read 0.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <thread>
#include <utility>

#include "platform.h"

namespace mesp {

FileView& FileView::operator=(FileView&& o) noexcept {
  if (this != &o) {
    release();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    mapped_ = std::exchange(o.mapped_, false);
  }
  return *this;
}

bool FileView::open(const std::string& path, std::string& why) {
  release();
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    why = std::strerror(errno);
    return false;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    why = "not a regular file";
    ::close(fd);
    return false;
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ == 0) {  // mmap refuses length 0; an empty view is fine
    ::close(fd);
    return true;
  }
  void* p = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p != MAP_FAILED) {
    data_ = static_cast<const uint8_t*>(p);
    mapped_ = true;
    ::close(fd);
    return true;
  }
  // No mmap (some sandboxes): read the file instead.
  uint8_t* buf = new uint8_t[size_];
  size_t got = 0;
  while (got < size_) {
    ssize_t r = ::read(fd, buf + got, size_ - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      why = r < 0 ? std::strerror(errno) : "file shrank while reading";
      delete[] buf;
      ::close(fd);
      size_ = 0;
      return false;
    }
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  data_ = buf;
  return true;
}

void FileView::release() {
  if (data_ != nullptr) {
    if (mapped_)
      munmap(const_cast<uint8_t*>(data_), size_);
    else
      delete[] data_;
  }
  data_ = nullptr;
  size_ = 0;
  mapped_ = false;
}

namespace {

// All of n bytes at offset through pread (write false) or pwrite (write true), retrying short
// transfers and EINTR; false with `why` on an error or an early end of file.
bool transfer_all(int fd, uint64_t offset, uint8_t* p, size_t n, bool write, std::string& why) {
  size_t done = 0;
  while (done < n) {
    const off_t at = static_cast<off_t>(offset + done);
    ssize_t r = write ? pwrite(fd, p + done, n - done, at) : pread(fd, p + done, n - done, at);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      why = r < 0 ? std::strerror(errno) : (write ? "nothing written" : "unexpected end of file");
      return false;
    }
    done += static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

bool read_at(const std::string& path, uint64_t offset, size_t n, std::string& out,
             std::string& why) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    why = std::strerror(errno);
    return false;
  }
  out.assign(n, '\0');
  const bool ok = transfer_all(fd, offset, reinterpret_cast<uint8_t*>(&out[0]), n, false, why);
  ::close(fd);
  return ok;
}

ScratchFile::~ScratchFile() {
  if (fd_ >= 0) ::close(fd_);
}

ScratchFile& ScratchFile::operator=(ScratchFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

bool ScratchFile::open(const std::string& dir, std::string& why) {
  std::string tmpl = (dir.empty() ? std::string(".") : dir) + "/.mesp-checkpoints-XXXXXX";
  int fd = mkstemp(&tmpl[0]);
  if (fd < 0) {
    why = std::strerror(errno);
    return false;
  }
  ::unlink(tmpl.c_str());  // nameless from here on: gone when closed, whatever happens
  (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
  return true;
}

bool ScratchFile::write(uint64_t offset, const void* p, size_t n, std::string& why) {
  // pwrite only reads the buffer: the cast serves the one helper for both directions
  return transfer_all(fd_, offset, const_cast<uint8_t*>(static_cast<const uint8_t*>(p)), n, true,
                      why);
}

bool ScratchFile::read(uint64_t offset, void* p, size_t n, std::string& why) const {
  return transfer_all(fd_, offset, static_cast<uint8_t*>(p), n, false, why);
}

int64_t file_size(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return -1;
  return static_cast<int64_t>(st.st_size);
}

bool is_dir(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

static std::string parent_of(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

bool dir_writable(const std::string& path, std::string& why) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  struct stat st;
  while (stat(p.c_str(), &st) != 0) {
    if (errno != ENOENT) {
      why = p + ": " + std::strerror(errno);
      return false;
    }
    std::string up = parent_of(p);
    if (up == p) break;
    p = up;
  }
  if (!S_ISDIR(st.st_mode)) {
    why = p + ": not a directory";
    return false;
  }
  if (access(p.c_str(), W_OK | X_OK) != 0) {
    why = p + ": " + std::strerror(errno);
    return false;
  }
  return true;
}

bool make_dirs(const std::string& path, std::string& why) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i < path.size() && path[i] != '/') continue;
    std::string part = path.substr(0, i);
    if (mkdir(part.c_str(), 0777) != 0 && errno != EEXIST) {
      why = part + ": " + std::strerror(errno);
      return false;
    }
  }
  if (!is_dir(path)) {
    why = path + ": not a directory";
    return false;
  }
  return true;
}

bool write_atomic(const std::string& path, const std::string& bytes, std::string& why) {
  return write_atomic(path, std::vector<ByteSpan>{{bytes.data(), bytes.size()}}, why);
}

bool write_atomic(const std::string& path, const std::vector<ByteSpan>& parts, std::string& why) {
  std::string dir = parent_of(path);
  std::string base = path.substr(path.find_last_of('/') + 1);
  std::string tmp = dir + "/." + base + ".XXXXXX";
  int fd = mkstemp(&tmp[0]);
  if (fd < 0) {
    why = std::strerror(errno);
    return false;
  }
  // mkstemp makes the file 0600; give it the mode a plain open() would (as mesp's Python
  // atomic_write does), so an adapter is readable by what reads it (a server, another user)
  const mode_t mask = umask(0);
  umask(mask);
  fchmod(fd, 0666 & ~mask);
  uint64_t offset = 0;
  for (const ByteSpan& part : parts) {
    auto* p = const_cast<uint8_t*>(static_cast<const uint8_t*>(part.data));  // only written out
    if (!transfer_all(fd, offset, p, part.size, true, why)) {
      ::close(fd);
      unlink(tmp.c_str());
      return false;
    }
    offset += part.size;
  }
  if (fsync(fd) != 0 || ::close(fd) != 0) {
    why = std::strerror(errno);
    unlink(tmp.c_str());
    return false;
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    why = std::strerror(errno);
    unlink(tmp.c_str());
    return false;
  }
  int dfd = ::open(dir.c_str(), O_RDONLY | O_CLOEXEC);
  if (dfd >= 0) {  // the rename itself made durable
    fsync(dfd);
    ::close(dfd);
  }
  return true;
}

MemInfo mem_info() {
  MemInfo m;
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    unsigned long long kb = 0;
    if (std::sscanf(line.c_str(), "VmHWM: %llu kB", &kb) == 1) m.peak_rss = kb * 1024;
    if (std::sscanf(line.c_str(), "RssAnon: %llu kB", &kb) == 1) m.rss_anon = kb * 1024;
  }
  return m;
}

MemInfo mem_detail() {
  MemInfo m = mem_info();
  std::ifstream f("/proc/self/smaps_rollup");  // Linux 4.14+; stays 0 where absent
  std::string line;
  while (std::getline(f, line)) {
    unsigned long long kb = 0;
    if (std::sscanf(line.c_str(), "Private_Dirty: %llu kB", &kb) == 1) m.private_dirty = kb * 1024;
  }
  return m;
}

ZeroPages::ZeroPages(size_t n) : size_(n > 0 ? n : 1) {
  void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p != MAP_FAILED) {
    data_ = p;
    mapped_ = true;
  } else {
    data_ = std::calloc(size_, 1);
    if (data_ == nullptr) throw std::bad_alloc();
  }
}

ZeroPages::~ZeroPages() {
  if (mapped_)
    munmap(data_, size_);
  else
    std::free(data_);
}

namespace {
std::atomic<uint64_t> g_anon_peak{0};
std::atomic<uint64_t> g_anon_window{0};  // since the last anon_watch_take()

void raise_to(std::atomic<uint64_t>& peak, uint64_t now) {
  uint64_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}
std::atomic<bool> g_anon_watching{false};

// RssAnon from statm's second and third fields (resident, shared = RssFile + RssShmem), in
// bytes; 0 when it cannot be read. pread: procfs regenerates the text at offset 0 each time.
uint64_t statm_anon(int fd, uint64_t page) {
  char buf[160];
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return 0;
  buf[n] = '\0';
  unsigned long long size = 0, resident = 0, shared = 0;
  if (std::sscanf(buf, "%llu %llu %llu", &size, &resident, &shared) != 3 || shared > resident)
    return 0;
  return (resident - shared) * page;
}
}  // namespace

void start_anon_watch(int period_us) {
  if (period_us <= 0 || g_anon_watching.exchange(true)) return;
  const int fd = ::open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;  // no procfs: the between-program samples are all there is
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  // Detached: it touches only the fd and two atomics, so it may run on while the process exits.
  std::thread([fd, page, period_us] {
    const auto period = std::chrono::microseconds(period_us);
    for (;;) {
      const uint64_t now = statm_anon(fd, page);
      raise_to(g_anon_peak, now);
      raise_to(g_anon_window, now);
      std::this_thread::sleep_for(period);
    }
  }).detach();
}

uint64_t anon_watch_peak() {
  return g_anon_peak.load(std::memory_order_relaxed);
}

uint64_t anon_watch_take() {
  return g_anon_window.exchange(0);
}

static void interrupted(int) {
  static const char msg[] = "mesp-runner: interrupted; no adapter written\n";
  ssize_t ignored = ::write(2, msg, sizeof msg - 1);  // async-signal-safe, unlike stdio
  (void)ignored;
  _exit(130);
}

void on_interrupt_exit() {
  struct sigaction sa = {};
  sa.sa_handler = interrupted;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

}  // namespace mesp

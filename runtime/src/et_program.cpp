#include "et_program.h"

#include <executorch/extension/data_loader/file_data_loader.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/hierarchical_allocator.h>
#include <executorch/runtime/executor/memory_manager.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/platform.h>
#include <executorch/runtime/platform/runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include "error.h"
#include "platform.h"

struct pthreadpool;  // pthreadpool's opaque pool (C, global namespace)

// The wheel ships no threadpool.h; these declarations match libexecutorch_threadpool.so
// (extension/threadpool/threadpool.h upstream: non-virtual members, so the ABI is the symbol).
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
::pthreadpool* get_pthreadpool();  // the pool XNNPACK's kernels run on
}  // namespace executorch::extension::threadpool
extern "C" size_t pthreadpool_get_threads_count(::pthreadpool* pool);

namespace mesp {

namespace et = executorch::runtime;
namespace ea = executorch::aten;
using executorch::extension::FileDataLoader;
using executorch::extension::MallocMemoryAllocator;

namespace {

// ExecuTorch logs through its PAL. The runner's errors must be one line, so its messages are
// kept (the last error is quoted in ours) instead of printed; MESP_ET_LOG=1 prints them.
std::string g_last_log;
bool g_print_log = false;

void on_log(et_timestamp_t, et_pal_log_level_t level, const char* file, const char*, size_t line,
            const char* msg, size_t len) {
  std::string m(msg, len);
  while (!m.empty() && (m.back() == '\n' || m.back() == '\r')) m.pop_back();
  if (level == kError || level == kFatal) g_last_log = m;
  if (g_print_log)
    std::fprintf(stderr, "[executorch %c %s:%zu] %s\n", level, file, line, m.c_str());
}

// ET_CHECK failures end in the PAL's abort: still one line and exit code 2, never a core dump.
[[noreturn]] void on_abort() {
  std::string m = g_last_log.empty() ? "" : ": " + g_last_log;
  for (char& c : m)
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  std::fprintf(stderr, "mesp-runner: error: ExecuTorch aborted%s; no adapter written\n", m.c_str());
  std::fflush(stderr);
  std::_Exit(2);
}

std::string last_log() {
  std::string m = g_last_log;
  g_last_log.clear();
  return m.empty() ? "" : "; ExecuTorch: " + m;
}

std::string err(et::Error e) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%x", static_cast<unsigned>(e));
  return std::string(et::to_string(e)) + " (" + buf + ")";
}

ea::ScalarType scalar_type(DType t) {
  switch (t) {
    case DType::F32: return ea::ScalarType::Float;
    case DType::F16: return ea::ScalarType::Half;
    case DType::BF16: return ea::ScalarType::BFloat16;
    case DType::F64: return ea::ScalarType::Double;
    case DType::I64: return ea::ScalarType::Long;
    case DType::I32: return ea::ScalarType::Int;
    case DType::I16: return ea::ScalarType::Short;
    case DType::I8: return ea::ScalarType::Char;
    case DType::U8: return ea::ScalarType::Byte;
    case DType::BOOL: return ea::ScalarType::Bool;
    default: return ea::ScalarType::Undefined;
  }
}

DType dtype_of(ea::ScalarType t) {
  for (DType d : {DType::F32, DType::F16, DType::BF16, DType::F64, DType::I64, DType::I32,
                  DType::I16, DType::I8, DType::U8, DType::BOOL})
    if (scalar_type(d) == t) return d;
  return DType::Unknown;
}

// One program and its method. Members are declared in the order they must be built: the
// loader outlives the program, the allocators and memory manager outlive the method.
struct Loaded {
  const ProgramSpec* spec = nullptr;
  std::string path;
  std::unique_ptr<FileDataLoader> loader;
  std::unique_ptr<et::Program> program;
  std::vector<int64_t> planned;  // from MethodMeta
  MallocMemoryAllocator method_alloc;
  MallocMemoryAllocator temp_alloc;
  std::unique_ptr<et::HierarchicalAllocator> planned_memory;
  std::unique_ptr<et::MemoryManager> memory;
  std::unique_ptr<et::Method> method;
  double seconds = 0;  // in run() since the last take_times()
  int64_t calls = 0;
};

}  // namespace

struct Programs::Impl {
  std::map<std::string, std::unique_ptr<Loaded>> programs;
  std::vector<Buffer> arenas;  // one per planned-buffer index, the max size over programs
  std::vector<et::Span<uint8_t>> spans;
};

// Our log hook goes in before anything can log (the thread pool logs when it is created).
static void init_executorch() {
  static bool initialized = false;
  if (!initialized) {
    g_print_log = std::getenv("MESP_ET_LOG") != nullptr;
    et::register_pal(et::PalImpl::create(nullptr, on_abort, nullptr, nullptr, on_log, nullptr,
                                         nullptr, __FILE__));
    et::runtime_init();
    initialized = true;
  }
}

Programs::Programs() : impl_(new Impl) {
  init_executorch();
}

Programs::~Programs() = default;

void Programs::set_threads(int n) {
  init_executorch();
  if (n > 0) {
    auto* pool = executorch::extension::threadpool::get_threadpool();
    if (pool != nullptr) pool->_unsafe_reset_threadpool(static_cast<uint32_t>(n));
  }
}

int Programs::threads() {
  init_executorch();
  ::pthreadpool* pool = executorch::extension::threadpool::get_pthreadpool();
  return pool == nullptr ? 1 : static_cast<int>(pthreadpool_get_threads_count(pool));
}

static void check_meta(const Loaded& p, const et::MethodMeta& meta) {
  const ProgramSpec& s = *p.spec;
  auto bad = [&](const std::string& what) {
    throw RunnerError(p.path + ": " + what + " (not from this export?)");
  };
  if (meta.num_inputs() != s.inputs.size())
    bad("takes " + std::to_string(meta.num_inputs()) + " inputs, run_config.json lists " +
        std::to_string(s.inputs.size()));
  if (meta.num_outputs() != s.outputs.size())
    bad("returns " + std::to_string(meta.num_outputs()) + " outputs, run_config.json lists " +
        std::to_string(s.outputs.size()));
  for (size_t io = 0; io < 2; ++io) {
    const auto& specs = io == 0 ? s.inputs : s.outputs;
    for (size_t i = 0; i < specs.size(); ++i) {
      auto info = io == 0 ? meta.input_tensor_meta(i) : meta.output_tensor_meta(i);
      std::string what = (io == 0 ? "input " : "output ") + specs[i].name;
      if (!info.ok()) bad(what + " is not a tensor");
      Shape got;
      for (int32_t d : info->sizes()) got.push_back(d);
      if (dtype_of(info->scalar_type()) != specs[i].dtype || got != specs[i].shape)
        bad(what + " is " + dtype_name(dtype_of(info->scalar_type())) + shape_str(got) +
            ", run_config.json says " + dtype_name(specs[i].dtype) + shape_str(specs[i].shape));
    }
  }
}

// XNNPACK's workspace (its activation arena) is per delegate call unless the library was built
// with ENABLE_XNNPACK_SHARED_WORKSPACE or told otherwise at run time; the
// runner runs one program at a time, so every delegate call of every method shares one: the
// backend's "Global" mode (WorkspaceSharingMode::Global = 2 in XNNPACKBackend.h, which the
// wheel does not ship). It must be set before the methods' delegates are initialized.
static void share_xnnpack_workspace() {
  et::BackendOptions<1> opts;
  if (opts.set_option("workspace_sharing_mode", 2) != et::Error::Ok ||
      et::set_option("XnnpackBackend", opts.view()) != et::Error::Ok)
    throw RunnerError("XNNPACK refused its workspace sharing mode (an executorch other than 1.5?)");
}

void Programs::load(const Artifacts& art) {
  share_xnnpack_workspace();
  // Pass 1: deserialize each program, check it, learn its planned buffer sizes.
  size_t n_buffers = 0;
  for (const auto& [name, spec] : art.programs) {
    auto p = std::make_unique<Loaded>();
    p->spec = &spec;
    p->path = art.path(spec.pte);
    auto loader = FileDataLoader::from(p->path.c_str());
    if (!loader.ok())
      throw RunnerError(p->path + ": cannot open (" + err(loader.error()) + last_log() + ")");
    p->loader = std::make_unique<FileDataLoader>(std::move(loader.get()));
    auto program =
        et::Program::load(p->loader.get(), et::Program::Verification::InternalConsistency);
    if (!program.ok())
      throw RunnerError(p->path + ": ExecuTorch refused the program: " + err(program.error()) +
                        last_log());
    p->program = std::make_unique<et::Program>(std::move(program.get()));
    auto meta = p->program->method_meta(spec.method.c_str());
    if (!meta.ok())
      throw RunnerError(p->path + ": has no method \"" + spec.method + "\" (" + err(meta.error()) +
                        ")");
    check_meta(*p, meta.get());
    for (size_t i = 0; i < meta->num_memory_planned_buffers(); ++i) {
      auto size = meta->memory_planned_buffer_size(i);
      if (!size.ok() || size.get() < 0) throw RunnerError(p->path + ": bad planned buffer size");
      p->planned.push_back(size.get());
    }
    // run_config.json lists either MethodMeta's sizes or the plan's raw list, which starts
    // with ExecuTorch's reserved buffer id 0 (size 0).
    std::vector<int64_t> raw = {0};
    raw.insert(raw.end(), p->planned.begin(), p->planned.end());
    if (!spec.planned_bytes.empty() && spec.planned_bytes != p->planned &&
        spec.planned_bytes != raw)
      throw RunnerError(p->path +
                        ": planned buffers differ from run_config.json (not from this export)");
    n_buffers = std::max(n_buffers, p->planned.size());
    impl_->programs[name] = std::move(p);
  }
  // The shared arenas: buffer i sized to the largest buffer i of any program.
  std::vector<size_t> sizes(n_buffers, 0);
  for (const auto& kv : impl_->programs)
    for (size_t i = 0; i < kv.second->planned.size(); ++i)
      sizes[i] = std::max(sizes[i], static_cast<size_t>(kv.second->planned[i]));
  for (size_t i = 0; i < n_buffers; ++i) {
    impl_->arenas.emplace_back(sizes[i]);
    impl_->spans.emplace_back(impl_->arenas.back().data(), sizes[i]);
  }
  // Pass 2: the methods, each seeing exactly the buffer count its program plans.
  for (auto& [name, p] : impl_->programs) {
    p->planned_memory = std::make_unique<et::HierarchicalAllocator>(
        et::Span<et::Span<uint8_t>>(impl_->spans.data(), p->planned.size()));
    p->memory = std::make_unique<et::MemoryManager>(&p->method_alloc, p->planned_memory.get(),
                                                    &p->temp_alloc);
    auto method = p->program->load_method(p->spec->method.c_str(), p->memory.get());
    if (!method.ok())
      throw RunnerError(p->path + ": ExecuTorch cannot load its method: " + err(method.error()) +
                        last_log());
    p->method = std::make_unique<et::Method>(std::move(method.get()));
  }
}

void Programs::warm_up() {
  std::vector<std::string> order;
  size_t most = 0;
  for (const auto& [name, p] : impl_->programs) {
    const bool backward = name.size() > 9 && name.compare(name.size() - 9, 9, ".backward") == 0;
    order.insert(backward ? order.begin() : order.end(), name);
    for (const IoSpec& in : p->spec->inputs)
      most = std::max(most, static_cast<size_t>(numel(in.shape)) * dtype_size(in.dtype));
  }
  ZeroPages zeros(most);
  for (const std::string& name : order) {
    std::vector<TensorRef> inputs;
    for (const IoSpec& in : impl_->programs.at(name)->spec->inputs)
      inputs.push_back(TensorRef{in.dtype, in.shape, zeros.data()});
    run(name, inputs);
  }
}

uint64_t Programs::planned_bytes() const {
  uint64_t n = 0;
  for (const auto& a : impl_->arenas) n += a.size();
  return n;
}

std::vector<TensorRef> Programs::run(const std::string& name,
                                     const std::vector<TensorRef>& inputs) {
  auto it = impl_->programs.find(name);
  if (it == impl_->programs.end()) throw RunnerError("no program " + name);
  Loaded& p = *it->second;
  const ProgramSpec& s = *p.spec;
  if (inputs.size() != s.inputs.size()) throw RunnerError(name + ": wrong number of inputs");
  const double t0 = now_seconds();
  // Inputs are not memory-planned (the method keeps a pointer to our data), and the arenas are
  // shared, so every input is set again before every execute.
  for (size_t i = 0; i < inputs.size(); ++i) {
    const TensorRef& in = inputs[i];
    const size_t dim = in.shape.size();
    std::vector<ea::TensorImpl::SizesType> sizes(dim);
    std::vector<ea::TensorImpl::DimOrderType> order(dim);
    std::vector<ea::TensorImpl::StridesType> strides(dim);
    int64_t stride = 1;
    for (size_t d = dim; d-- > 0;) {
      sizes[d] = static_cast<ea::TensorImpl::SizesType>(in.shape[d]);
      order[d] = static_cast<ea::TensorImpl::DimOrderType>(d);
      strides[d] = static_cast<ea::TensorImpl::StridesType>(stride);
      stride *= in.shape[d];
    }
    ea::TensorImpl impl(scalar_type(in.dtype), static_cast<ssize_t>(dim), sizes.data(), in.data,
                        order.data(), strides.data());
    et::Error e = p.method->set_input(et::EValue(ea::Tensor(&impl)), i);
    if (e != et::Error::Ok)
      throw RunnerError(p.path + ": input " + s.inputs[i].name + " " + dtype_name(in.dtype) +
                        shape_str(in.shape) + " refused: " + err(e) + last_log());
  }
  et::Error e = p.method->execute();
  if (e != et::Error::Ok) throw RunnerError(p.path + ": execution failed: " + err(e) + last_log());
  std::vector<et::EValue> outs(s.outputs.size());
  e = p.method->get_outputs(outs.data(), outs.size());
  if (e != et::Error::Ok) throw RunnerError(p.path + ": no outputs: " + err(e) + last_log());
  std::vector<TensorRef> result;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!outs[i].isTensor())
      throw RunnerError(p.path + ": output " + s.outputs[i].name + " is not a tensor");
    const ea::Tensor& t = outs[i].toTensor();
    TensorRef r;
    r.dtype = dtype_of(t.scalar_type());
    for (ssize_t d = 0; d < t.dim(); ++d) r.shape.push_back(t.size(d));
    r.data = t.mutable_data_ptr();
    if (r.dtype != s.outputs[i].dtype || r.shape.size() != s.outputs[i].shape.size() ||
        (r.data == nullptr && r.nbytes() > 0))
      throw RunnerError(p.path + ": output " + s.outputs[i].name + " came back as " +
                        dtype_name(r.dtype) + shape_str(r.shape));
    result.push_back(r);
  }
  p.seconds += now_seconds() - t0;
  ++p.calls;
  return result;
}

std::vector<Programs::Time> Programs::take_times() {
  std::vector<Time> out;
  for (auto& [name, p] : impl_->programs) {
    if (p->calls > 0) out.push_back({name, p->seconds, p->calls});
    p->seconds = 0;
    p->calls = 0;
  }
  return out;
}

}  // namespace mesp

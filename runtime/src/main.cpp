// mesp-runner: trains LoRA adapters from a `mesp export --target executorch` directory with the
// ExecuTorch runtime alone (no Python, no libtorch). See runtime/README.md.
//
//   mesp-runner DIR --data ROWS.jsonl --steps N [--optimizer sgd|adamw] [--lr 1e-4]
//               [--weight-decay 0] --out ADAPTER_DIR [--quiet] [--threads N] [--json-log FILE]
//               [--memory-poll-us 1000]
//               [--dp-clip C (--dp-noise S | --dp-epsilon E) [--dp-delta D] [--dp-batch N]
//                [--dp-clipping per-layer|flat] [--seed 0]]   (DP-SGD: private.h)
//
// Every error is one line on stderr, "mesp-runner: error: <what>", exit code 2, no adapter.
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <string>
#include <vector>

#include "artifacts.h"
#include "data.h"
#include "error.h"
#include "et_program.h"
#include "json.h"
#include "platform.h"
#include "private.h"
#include "train.h"

namespace mesp {
namespace {

const char* kUsage =
    "usage: mesp-runner DIR --data ROWS.jsonl --steps N --out ADAPTER_DIR\n"
    "                   [--optimizer sgd|adamw] [--lr 1e-4] [--weight-decay 0]\n"
    "                   [--quiet] [--threads N] [--json-log FILE] [--checkpoints-dir DIR]\n"
    "                   (--threads: default $OMP_NUM_THREADS, else one per core)\n"
    "                   [--checkpoint-dtype float32|float16|bfloat16]  (block inputs kept as)\n"
    "                   [--memory-poll-us 1000]  (0: anon memory sampled between programs only)\n"
    "DP-SGD (each row's gradient clipped, Gaussian noise, the privacy spent printed per step):\n"
    "                   --dp-clip C (--dp-noise SIGMA | --dp-epsilon EPS) [--dp-delta D]\n"
    "                   [--dp-batch E]  (expected rows per step, Poisson; default the export's)\n"
    "                   [--dp-clipping per-layer|flat] [--seed 0]\n"
    "Trains LoRA adapters from a `mesp export --target executorch` directory.\n";

constexpr long kMaxThreads = 1024;  // the most --threads (or OMP_NUM_THREADS) may ask for

// --threads 0 (the default): OMP_NUM_THREADS where it is a count from 1 to kMaxThreads, the
// knob torch (the engine beside the runner) honours too, so two processes sharing a machine can
// be told not to spin against each other; else 0, ExecuTorch's own choice (one per core).
int threads_from_env() {
  const char* v = std::getenv("OMP_NUM_THREADS");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  return (*end == '\0' && n >= 1 && n <= kMaxThreads) ? static_cast<int>(n) : 0;
}

struct Args {
  std::string dir, data, out, json_log, checkpoints_dir;
  DType checkpoint_dtype = DType::F32;
  int64_t steps = -1;
  OptimConfig opt;
  bool quiet = false;
  int threads = 0;
  int memory_poll_us = 1000;  // the anon watch's period (platform.h)
  DpFlags dp;
};

double parse_double(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  double d = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno == ERANGE)
    throw RunnerError(flag + ": expected a number, got '" + v + "'");
  return d;
}

int64_t parse_int(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  long long i = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno == ERANGE)
    throw RunnerError(flag + ": expected an integer, got '" + v + "'");
  return i;
}

Args parse_args(int argc, char** argv) {
  Args a;
  bool have_dir = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (arg.size() < 2 || arg.compare(0, 2, "--") != 0) {
      if (have_dir) throw RunnerError("unexpected argument '" + arg + "' (one DIR only)");
      a.dir = arg;
      have_dir = true;
      continue;
    }
    size_t eq = arg.find('=');
    bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    if (arg == "--quiet") {
      if (inline_value) throw RunnerError("--quiet takes no value");
      a.quiet = true;
      continue;
    }
    static const char* kValued[] = {"--data",    "--steps",    "--optimizer",
                                    "--lr",      "--weight-decay", "--out",
                                    "--threads", "--json-log", "--checkpoints-dir", "--checkpoint-dtype",
                                    "--memory-poll-us"};
    bool known = arg == "--seed" || arg.compare(0, 5, "--dp-") == 0;
    for (const char* k : kValued) known = known || arg == k;
    if (!known) throw RunnerError("unknown flag " + arg + " (see --help)");
    if (!inline_value) {
      if (i + 1 >= argc) throw RunnerError(arg + " needs a value");
      value = argv[++i];
    }
    if (parse_dp_flag(arg, value, a.dp))
      continue;
    if (arg.compare(0, 5, "--dp-") == 0)
      throw RunnerError("unknown flag " + arg + " (see --help)");
    if (arg == "--data")
      a.data = value;
    else if (arg == "--out")
      a.out = value;
    else if (arg == "--json-log")
      a.json_log = value;
    else if (arg == "--checkpoint-dtype") {
      if (value == "float32") a.checkpoint_dtype = DType::F32;
      else if (value == "float16") a.checkpoint_dtype = DType::F16;
      else if (value == "bfloat16") a.checkpoint_dtype = DType::BF16;
      else throw RunnerError("--checkpoint-dtype must be float32, float16 or bfloat16, not '" + value + "'");
    }
    else if (arg == "--checkpoints-dir") {
      if (value.empty()) throw RunnerError("--checkpoints-dir needs a directory");
      a.checkpoints_dir = value;
    }
    else if (arg == "--steps")
      a.steps = parse_int(arg, value);
    else if (arg == "--lr")
      a.opt.lr = parse_double(arg, value);
    else if (arg == "--weight-decay")
      a.opt.weight_decay = parse_double(arg, value);
    else if (arg == "--threads")
      a.threads = static_cast<int>(parse_int(arg, value));
    else if (arg == "--memory-poll-us") {
      const int64_t us = parse_int(arg, value);
      if (us < 0 || us > 1000000) throw RunnerError("--memory-poll-us must be between 0 and 1000000");
      a.memory_poll_us = static_cast<int>(us);
    }
    else if (arg == "--optimizer") {
      if (value != "sgd" && value != "adamw")
        throw RunnerError("--optimizer must be sgd or adamw, not '" + value + "'");
      a.opt.optimizer = value;
    }
  }
  if (!have_dir) throw RunnerError("missing the artifact directory DIR (see --help)");
  if (a.data.empty()) throw RunnerError("--data is required");
  if (a.out.empty()) throw RunnerError("--out is required");
  if (a.steps == -1) throw RunnerError("--steps is required");
  if (a.steps < 1 || !(a.opt.lr > 0 && std::isfinite(a.opt.lr)))
    throw RunnerError("--steps and --lr must be positive");
  if (!(a.opt.weight_decay >= 0 && std::isfinite(a.opt.weight_decay)))
    throw RunnerError("--weight-decay must be a finite number >= 0");
  if (a.threads < 0 || a.threads > kMaxThreads)
    throw RunnerError("--threads must be between 0 and " + std::to_string(kMaxThreads));
  if (a.threads == 0) a.threads = threads_from_env();
  return a;
}

// `v` printed with `fmt`, or `inf` when it is not finite (noise 0: no guarantee).
std::string number_text(double v, const char* fmt, const char* inf) {
  if (!std::isfinite(v)) return inf;
  char buf[40];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

// {"g0.forward": {"s": 1.234567, "calls": 24}, ...}: where the step's time went, program by program
std::string programs_json(const std::vector<Programs::Time>& times) {
  std::string s = "{";
  for (const Programs::Time& t : times) {
    char buf[64];
    std::snprintf(buf, sizeof buf, ": {\"s\": %.6f, \"calls\": %lld}", t.seconds,
                  static_cast<long long>(t.calls));
    s += (s.size() > 1 ? ", " : "") + json_quote(t.name) + buf;
  }
  return s + "}";
}

double mib(uint64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

int run(int argc, char** argv) {
  const double t0 = now_seconds();
  on_interrupt_exit();
  Args a = parse_args(argc, argv);
  start_anon_watch(a.memory_poll_us);  // before anything is loaded: loading's transients count
  std::string why;
  if (file_size(a.out) >= 0) throw RunnerError(a.out + ": exists and is not a directory");
  if (!dir_writable(a.out, why))
    throw RunnerError(a.out + ": cannot write the adapter there (" + why + ")");

  // Everything cheap first: config, file headers, hashes, data, program bindings.
  Artifacts art = load_artifacts(a.dir);
  std::vector<Row> rows = read_rows(a.data, art.seq_len, art.vocab);
  Trainer trainer(art, a.opt, a.checkpoints_dir, a.checkpoint_dtype);
  const std::optional<DpPlan> dp = resolve_dp(a.dp, static_cast<int64_t>(rows.size()), a.steps,
                                              art.batch_size);
  if (dp) trainer.enable_dp(*dp);
  std::FILE* log = nullptr;
  if (!a.json_log.empty()) {
    log = std::fopen(a.json_log.c_str(), "w");
    if (log == nullptr)
      throw RunnerError(a.json_log + ": cannot write (" + std::strerror(errno) + ")");
  }

  Programs::set_threads(a.threads);
  Programs programs;
  programs.load(art);
  programs.warm_up();  // XNNPACK's workspace at its largest before the adapter is loaded
  trainer.prepare(programs);
  trainer.note_memory("after load");
  programs.take_times();  // the warm-up's runs are no step's

  for (int64_t k = 1; k <= a.steps; ++k) {
    const double ts = now_seconds();
    int64_t sampled = 0;
    std::optional<double> loss;
    if (dp) {
      loss = trainer.step_private(rows, k, sampled);
    } else {
      loss = trainer.step(make_batch(rows, k, art.batch_size, art.seq_len), k);
    }
    std::string dp_note, dp_json;  // DP-SGD: the step's sample size and the epsilon spent
    if (dp) {
      const double eps = dp->epsilon(k);
      dp_note = " rows " + std::to_string(sampled) + " epsilon " + number_text(eps, "%.6f", "inf");
      dp_json = ", \"rows\": " + std::to_string(sampled) +
                ", \"epsilon\": " + number_text(eps, "%.17g", "null");
    }
    const double dt = now_seconds() - ts;
    const std::vector<Programs::Time> times = programs.take_times();
    const MemInfo m = mem_info();
    if (!a.quiet) {
      char shown[64];
      if (loss)
        std::snprintf(shown, sizeof shown, "%.6f", *loss);
      else
        std::snprintf(shown, sizeof shown, dp ? "none (noise only)" : "skipped (no trained token)");
      std::printf("step %lld loss %s time %.3fs peak_rss %.1fMiB anon %.1fMiB%s\n",
                  static_cast<long long>(k), shown, dt, mib(m.peak_rss), mib(trainer.peak_anon()),
                  dp_note.c_str());
      std::fflush(stdout);
    }
    if (log != nullptr) {
      char shown[64];
      if (loss)
        std::snprintf(shown, sizeof shown, "%.17g", *loss);
      else
        std::snprintf(shown, sizeof shown, "null");
      // "memory": after load and around each program's first run (step 1), else []
      std::fprintf(log,
                   "{\"step\": %lld, \"loss\": %s, \"time_s\": %.6f, \"peak_rss_bytes\": %llu, "
                   "\"anon_bytes\": %llu, \"checkpoint_bytes\": %llu, \"memory\": %s, "
                   "\"programs\": %s%s}\n",
                   static_cast<long long>(k), shown, dt,
                   static_cast<unsigned long long>(m.peak_rss),
                   static_cast<unsigned long long>(trainer.peak_anon()),
                   static_cast<unsigned long long>(trainer.checkpoint_bytes()),
                   trainer.take_memory_events().c_str(), programs_json(times).c_str(),
                   dp_json.c_str());
      std::fflush(log);
    }
  }
  const std::string note = trainer.save(a.out);  // "" or why there is no adapter.gguf
  if (!note.empty()) std::printf("%s\n", note.c_str());
  if (dp) {  // the guarantee the adapter was trained under, beside it (as `mesp train` writes)
    std::string why;
    if (!write_atomic(a.out + "/privacy.json", dp->privacy_json(a.steps), why))
      throw RunnerError(a.out + ": could not save privacy.json (" + why + ")");
    const double eps = dp->epsilon(a.steps);
    const std::string spent = "epsilon = " + number_text(eps, "%.3f", "inf");
    std::printf("DP-SGD: %s at delta = %.3g after %lld steps (noise sigma = %.4g, bound C = %g, "
                "%s, sampling rate q = %.4g); the guarantee is in privacy.json\n",
                std::isfinite(eps) ? spent.c_str() : "no guarantee (noise 0)",
                dp->delta, static_cast<long long>(a.steps), dp->sigma, dp->clip,
                dp->flat ? "flat" : "per-layer", dp->q);
  }
  const MemInfo m = mem_info();
  std::printf(
      "saved %s after %lld steps in %.1f s; peak RSS %.1f MiB (anon %.1f MiB, polled every %d "
      "us); planned memory %.1f MiB; %d threads\n",
      a.out.c_str(), static_cast<long long>(a.steps), now_seconds() - t0, mib(m.peak_rss),
      mib(trainer.peak_anon()), a.memory_poll_us, mib(programs.planned_bytes()),
      Programs::threads());
  std::fflush(stdout);
  if (log != nullptr) std::fclose(log);
  return 0;
}

}  // namespace
}  // namespace mesp

// The one error line: control characters (a newline in a path or a log) become spaces.
static int fail(const std::string& what) {
  std::string line = what;
  for (char& c : line)
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  std::fprintf(stderr, "mesp-runner: error: %s\n", line.c_str());
  return 2;
}

int main(int argc, char** argv) {
  try {
    return mesp::run(argc, argv);
  } catch (const mesp::RunnerError& e) {
    return fail(e.what());
  } catch (const std::bad_alloc&) {
    return fail("out of memory");
  } catch (const std::exception& e) {
    return fail(std::string("internal: ") + e.what());
  }
}

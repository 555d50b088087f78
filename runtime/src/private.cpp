// DP-SGD's flags, accountant and generator (private.h).
#include "private.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "error.h"

namespace mesp {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kMaxNoise = 1000.0;  // as mesp/training/privacy.py's MAX_NOISE

double number(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  const double d = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno == ERANGE)
    throw RunnerError(flag + ": expected a number, got '" + v + "'");
  return d;
}

double log_add(double a, double b) {
  const double lo = std::min(a, b), hi = std::max(a, b);
  if (lo == -kInf) return hi;
  return std::log1p(std::exp(lo - hi)) + hi;
}

double log_comb(double n, double k) {
  return std::lgamma(n + 1) - std::lgamma(k + 1) - std::lgamma(n - k + 1);
}

// log(erfc(x)); past erfc's underflow, its asymptotic series (as dp-accounting's fallback).
double log_erfc(double x) {
  const double r = std::erfc(x);
  if (r > 0) return std::log(r);
  const double x2 = x * x;
  return -std::log(M_PI) / 2 - std::log(x) - x2 - 0.5 / x2 + 0.625 / (x2 * x2) -
         37.0 / 24.0 / (x2 * x2 * x2) + 353.0 / 64.0 / (x2 * x2 * x2 * x2);
}

// log A_alpha of the sampled Gaussian, integer alpha, 0 < q < 1.
double log_a_int(double q, double sigma, int alpha) {
  double log_a = -kInf;
  const double log1mq = std::log1p(-q), logq = std::log(q);
  for (int i = 0; i <= alpha; ++i) {
    const double c = log_comb(alpha, i) + i * logq + (alpha - i) * log1mq;
    log_a = log_add(log_a, c + (static_cast<double>(i) * i - i) / (2 * sigma * sigma));
  }
  return log_a;
}

// Fractional alpha (Mironov et al. 2019, Sec. 3.3): two series, to 1000 terms.
double log_a_frac(double q, double sigma, double alpha) {
  double a0 = -kInf, a1 = -kInf, last0 = -kInf, last1 = -kInf;
  const double z0 = sigma * sigma * std::log(1 / q - 1) + 0.5, log1mq = std::log1p(-q);
  const double logq = std::log(q), s2 = 2 * sigma * sigma;
  for (int i = 0; i < 1000; ++i) {
    const double c = log_comb(alpha, i), j = alpha - i;
    const double t0 = c + i * logq + j * log1mq, t1 = c + j * logq + i * log1mq;
    const double e0 = std::log(0.5) + log_erfc((i - z0) / (std::sqrt(2.0) * sigma));
    const double e1 = std::log(0.5) + log_erfc((z0 - j) / (std::sqrt(2.0) * sigma));
    const double s0 = t0 + (static_cast<double>(i) * i - i) / s2 + e0;
    const double s1 = t1 + (j * j - j) / s2 + e1;
    a0 = log_add(a0, s0);
    a1 = log_add(a1, s1);
    const double total = log_add(a0, a1);
    if (s0 < last0 && s1 < last1 && std::max(s0, s1) < total - 30) return total;
    last0 = s0;
    last1 = s1;
  }
  return kInf;  // no convergence: the order is left out (its epsilon is infinite)
}

std::string fmt(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

}  // namespace

bool parse_dp_flag(const std::string& arg, const std::string& v, DpFlags& f) {
  if (arg == "--seed") {
    char* end = nullptr;
    errno = 0;
    const long long s = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || errno == ERANGE || s < 0)
      throw RunnerError("--seed: expected an integer >= 0, got '" + v + "'");
    f.seed = s;
    f.seeded = true;
    return true;
  }
  if (arg == "--dp-clip") f.clip = number(arg, v);
  else if (arg == "--dp-noise") f.noise = number(arg, v);
  else if (arg == "--dp-epsilon") f.epsilon = number(arg, v);
  else if (arg == "--dp-delta") f.delta = number(arg, v);
  else if (arg == "--dp-batch") f.batch = number(arg, v);
  else if (arg == "--dp-clipping") {
    if (v != "per-layer" && v != "flat")
      throw RunnerError("--dp-clipping must be per-layer or flat, not '" + v + "'");
    f.clipping = v;
  } else {
    return false;
  }
  f.any = true;
  return true;
}

std::optional<DpPlan> resolve_dp(const DpFlags& f, int64_t n_rows, int64_t steps,
                                 int64_t batch_size) {
  if (!f.any) {
    if (f.seeded) throw RunnerError("--seed needs --dp-clip (only DP-SGD draws random numbers)");
    return std::nullopt;
  }
  if (!f.clip) throw RunnerError("--dp-noise/--dp-epsilon/--dp-delta/--dp-clipping/--dp-batch need --dp-clip");
  const double c = *f.clip;
  if (!(c > 0 && std::isfinite(c))) throw RunnerError("--dp-clip must be a positive number");
  if (f.noise && !(*f.noise >= 0 && std::isfinite(*f.noise)))
    throw RunnerError("--dp-noise must be 0 or more");
  if (f.epsilon && !(*f.epsilon > 0 && std::isfinite(*f.epsilon)))
    throw RunnerError("--dp-epsilon must be positive");
  if (f.delta && !(*f.delta > 0 && *f.delta < 1)) throw RunnerError("--dp-delta must be in (0, 1)");
  if (f.noise.has_value() == f.epsilon.has_value())
    throw RunnerError("DP-SGD needs one of --dp-noise SIGMA or --dp-epsilon EPS");
  const double e = f.batch ? *f.batch : static_cast<double>(batch_size);
  if (!(e > 0 && std::isfinite(e))) throw RunnerError("--dp-batch must be a positive number");
  DpPlan p;
  p.clip = c;
  p.flat = f.clipping == "flat";
  p.seed = f.seed;
  p.q = std::min(1.0, e / static_cast<double>(n_rows));
  p.expected = p.q * static_cast<double>(n_rows);
  const double n = static_cast<double>(n_rows);
  p.delta = f.delta ? *f.delta : std::min(1e-5, 1.0 / (n * n));
  if (f.noise) {
    p.sigma = *f.noise;
  } else {
    p.sigma = solve_sigma(*f.epsilon, p.q, steps, p.delta);
    if (p.sigma < 0) {
      char buf[320];
      std::snprintf(buf, sizeof buf,
                    "--dp-epsilon %g cannot be met at delta=%g over %lld steps at sampling rate "
                    "%.4g: it needs a noise multiplier above %g (fewer --steps, a smaller "
                    "--dp-batch or a larger epsilon)",
                    *f.epsilon, p.delta, static_cast<long long>(steps), p.q, kMaxNoise);
      throw RunnerError(buf);
    }
  }
  p.rdp = rdp_poisson_gaussian(p.q, p.sigma);
  return p;
}

double DpPlan::epsilon(int64_t steps) const {
  return steps == 0 ? 0.0 : rdp_epsilon(rdp, static_cast<double>(steps), delta);
}

std::string DpPlan::privacy_json(int64_t steps) const {
  const double eps = epsilon(steps);
  return "{\n  \"clip\": " + fmt(clip) + ",\n  \"sigma\": " + fmt(sigma) + ",\n  \"q\": " +
         fmt(q) + ",\n  \"delta\": " + fmt(delta) + ",\n  \"clipping\": \"" +
         (flat ? "flat" : "per-layer") + "\",\n  \"expected\": " + fmt(expected) +
         ",\n  \"steps\": " + std::to_string(steps) +
         ",\n  \"epsilon\": " + (std::isfinite(eps) ? fmt(eps) : "null") +
         ",\n  \"accountant\": \"RDP, Poisson-subsampled Gaussian (dp-accounting's orders)\"" +
         ",\n  \"unit\": \"one training row (sequence)\"\n}\n";
}

const std::vector<double>& rdp_orders() {
  static const std::vector<double> orders = [] {
    std::vector<double> o;
    for (int x = 1; x < 100; ++x) o.push_back(1 + x / 10.0);
    for (int x = 11; x < 64; ++x) o.push_back(x);
    for (double x : {128.0, 256.0, 512.0, 1024.0}) o.push_back(x);
    return o;
  }();
  return orders;
}

std::vector<double> rdp_poisson_gaussian(double q, double sigma) {
  std::vector<double> out;
  for (double a : rdp_orders()) {
    if (q == 0) out.push_back(0);
    else if (sigma == 0) out.push_back(kInf);
    else if (q == 1) out.push_back(a / (2 * sigma * sigma));
    else if (a == std::floor(a)) out.push_back(log_a_int(q, sigma, static_cast<int>(a)) / (a - 1));
    else out.push_back(log_a_frac(q, sigma, a) / (a - 1));
  }
  return out;
}

double rdp_epsilon(const std::vector<double>& rdp, double steps, double delta) {
  const std::vector<double>& orders = rdp_orders();
  double best = kInf;
  for (size_t i = 0; i < orders.size(); ++i) {
    const double a = orders[i], r = rdp[i] * steps;
    double e;
    if (r < 0) e = 0;
    else if (delta * delta + std::expm1(-r) > 0) e = 0;
    else if (a > 1.01) e = r + std::log1p(-1 / a) - std::log(delta * a) / (a - 1);
    else e = kInf;
    best = std::min(best, e);
  }
  return std::max(0.0, best);
}

double solve_sigma(double eps, double q, int64_t steps, double delta) {
  auto spent = [&](double s) {
    return rdp_epsilon(rdp_poisson_gaussian(q, s), static_cast<double>(steps), delta);
  };
  if (spent(kMaxNoise) > eps) return -1;  // cannot be met
  double lo = 1e-3, hi = kMaxNoise;  // spent(hi) <= eps; epsilon falls as sigma grows
  if (spent(lo) <= eps) return lo;
  while (hi / lo > 1 + 1e-6) {
    const double mid = std::sqrt(lo * hi);
    (spent(mid) <= eps ? hi : lo) = mid;
  }
  return hi;
}

DpStream::DpStream(int64_t seed, int64_t step, uint64_t purpose)
    : key_(mix64(mix64(mix64(static_cast<uint64_t>(seed)) + static_cast<uint64_t>(step)) +
                 purpose)) {}

double DpStream::uniform(uint64_t i) const {
  return static_cast<double>(mix64(key_ + (i + 1) * kGolden) >> 11) * 0x1.0p-53;
}

double DpStream::normal(uint64_t i) const {
  const uint64_t m = i / 2;
  const double u1 = 1.0 - uniform(2 * m), u2 = uniform(2 * m + 1);
  const double r = std::sqrt(-2.0 * std::log(u1)), t = 2.0 * M_PI * u2;
  return i % 2 == 0 ? r * std::cos(t) : r * std::sin(t);
}

}  // namespace mesp

// The native runner's DP-SGD accountant and generator (runtime/src/private.cpp) on their own, for
// tests/test_ondevice_private.py: one query per argument list, one number per output line.
//   eps Q SIGMA STEPS DELTA | solve EPS Q STEPS DELTA | uniform SEED STEP PURPOSE N
//   | normal SEED STEP PURPOSE N
#include <cstdio>
#include <cstdlib>
#include <string>

#include "private.h"

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  auto d = [&](int i) { return std::strtod(argv[i], nullptr); };
  auto n = [&](int i) { return std::strtoll(argv[i], nullptr, 10); };
  if (what == "eps" && argc == 6) {
    std::printf("%.17g\n", mesp::rdp_epsilon(mesp::rdp_poisson_gaussian(d(2), d(3)), d(4), d(5)));
  } else if (what == "solve" && argc == 6) {
    std::printf("%.17g\n", mesp::solve_sigma(d(2), d(3), n(4), d(5)));
  } else if ((what == "uniform" || what == "normal") && argc == 6) {
    const mesp::DpStream s(n(2), n(3), static_cast<uint64_t>(n(4)));
    for (long long i = 0; i < n(5); ++i)
      std::printf("%.17g\n", what == "uniform" ? s.uniform(i) : s.normal(i));
  } else {
    std::fputs("usage: dp_probe eps|solve|uniform|normal ...\n", stderr);
    return 2;
  }
  return 0;
}

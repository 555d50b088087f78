// DP-SGD on the device: the flags, the seeded generator, the accountant. The step itself is
// Trainer::step_private (train_private.cpp). mesp/ondevice/private.py is the Python driver's
// twin: the same generator (so both drivers draw the same samples and noise) and the same
// step; the engine's DP-SGD (mesp/training/privacy.py) is the reference at noise 0.
//
// A step at sampling rate q = E / N (E = --dp-batch, the expected examples per step):
//   every row joins with probability q (uniform u_r < q, stream (seed, step, 0));
//   each sampled row runs alone (slot 0 of the exported batch, the others padded and
//   untrained: their gradients are exactly zero), its loss the mean over its own trained
//   tokens; each LoRA linear's (gA, gB) is clipped to C / sqrt(K) (per-layer, K linears) or
//   the whole adapter to C (flat), and added to the step's sum;
//   sum + N(0, (sigma C)^2) per coordinate (stream (seed, step, 1 + tensor index), blocks in
//   order, each block's tensors in its forward program's order), divided by E, goes to the
//   optimizer. An empty sample is a noise-only step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mesp {

struct DpFlags {
  std::optional<double> clip, noise, epsilon, delta, batch;
  std::string clipping = "per-layer";  // or "flat"
  int64_t seed = 0;
  bool any = false;  // some --dp-* flag was given
  bool seeded = false;  // --seed was given
};

// Takes a --dp-* or --seed flag with its value; false when `arg` is not one of them.
bool parse_dp_flag(const std::string& arg, const std::string& value, DpFlags& f);

// The resolved guarantee: the flags checked against the data (n_rows) and --steps.
struct DpPlan {
  double clip = 0, sigma = 0, q = 0, delta = 0, expected = 0;
  bool flat = false;
  int64_t seed = 0;
  std::vector<double> rdp;  // one step's RDP at each order of rdp_orders()
  double epsilon(int64_t steps) const;
  std::string privacy_json(int64_t steps) const;  // privacy.json, as the engine writes it
};

// Refuses bad flags in one line (RunnerError); nullopt when no --dp-* flag was given.
std::optional<DpPlan> resolve_dp(const DpFlags& f, int64_t n_rows, int64_t steps,
                                 int64_t batch_size);

// The accountant: RDP of the Poisson-subsampled Gaussian (Mironov, Talwar, Zhang 2019) at
// dp-accounting's default orders, and its conversion to (epsilon, delta) (Balle et al. 2020,
// Prop. 12), as dp_accounting.rdp.RdpAccountant computes them.
const std::vector<double>& rdp_orders();
std::vector<double> rdp_poisson_gaussian(double q, double sigma);
double rdp_epsilon(const std::vector<double>& rdp, double steps, double delta);
// The smallest sigma in [1e-3, 1000] (to 1e-6 relative) whose run spends at most eps.
double solve_sigma(double eps, double q, int64_t steps, double delta);

// A counter-based generator (SplitMix64's mixer on (key + (i + 1) * golden)): value i of the
// stream keyed by (seed, step, purpose), without state; uniforms in [0, 1) with 53 bits,
// normals by Box-Muller on the pair (2m, 2m + 1).
class DpStream {
 public:
  DpStream(int64_t seed, int64_t step, uint64_t purpose);
  double uniform(uint64_t i) const;
  double normal(uint64_t i) const;

 private:
  uint64_t key_;
};

}  // namespace mesp

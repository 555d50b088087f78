// The loss as the exporter cut it (mesp/ondevice/export_et.py, _loss_programs): one program per
// vocabulary slice, called in a loop, so that no program plans more than one slice of the head
// (the head rows are views into the mapped head file, one slice at a time):
//   loss_start   h, rows -> hs, m, s, tz, [ctg], acc   (final norm, trained rows, initial state)
//   loss_slice   head/* (rows v0..v0+chunk), v0, tgt, hs, state -> state   (online logsumexp)
//   loss_tail    the same for the last slice when chunk does not divide the vocabulary
//   loss_finish  h, rows, tgt, state, norm (+ the whole head for the target rows) -> loss, dh
// Each program's outputs are views into the shared arena: the state is copied back into the
// runner's buffers after every call, before the next program overwrites the arena.
#include <algorithm>
#include <cstring>

#include "error.h"
#include "train.h"
#include "train_util.h"

namespace mesp {

using namespace train_util;

namespace {
const char* kHeadKeys[] = {"weight", "scales", "biases"};
}  // namespace

TensorRef Trainer::rows_of(HostTensor& t, int64_t n) const {
  TensorRef r = ref(t);
  r.shape[0] = n;
  return r;
}

void Trainer::check_loss(const TensorRef& act) {
  const int64_t B = art_.batch_size, S = art_.seq_len;
  const TensorRef n_rows = ref(DType::I64, {B * S});
  const ProgramSpec& start = art_.program("loss_start");
  bind("loss_start", -1, {{"h", act}, {"rows", n_rows}}, false);
  for (const IoSpec& o : start.outputs) {
    if (o.shape.empty() || o.shape[0] != B * S || !o.is_dynamic(0))
      throw RunnerError(art_.path(start.pte) + ": output " + o.name + " must have B*S rows");
    state_names_.push_back(o.name);
    state_.emplace_back(o.dtype, o.shape);
  }
  if (state_names_.empty() || state_names_[0] != "hs")
    throw RunnerError(art_.path(start.pte) + ": its first output must be hs");
  std::map<std::string, TensorRef> named = {{"v0", ref(DType::I64, {})}, {"tgt", n_rows}};
  for (size_t i = 0; i < state_.size(); ++i) named[state_names_[i]] = ref(state_[i]);
  const Table& head = art_.files.at(art_.head_file);
  for (const char* prog : {"loss_slice", "loss_tail"}) {
    if (!art_.programs.count(prog)) continue;
    const int64_t width = prog[5] == 's' ? art_.loss_chunk : art_.vocab % art_.loss_chunk;
    std::map<std::string, TensorRef> with_head = named;
    for (const char* k : kHeadKeys) {
      auto t = head.find(art_.head_prefix + "." + k);
      if (t == head.end()) continue;
      Shape s = t->second.shape;
      if (s.empty() || s[0] != art_.vocab)
        throw RunnerError(art_.path(art_.head_file) + ": " + t->first + " has no vocabulary rows");
      s[0] = width;
      with_head[std::string("head/") + k] = ref(t->second.dtype, s);
    }
    bind(prog, -1, with_head, false);
    for (size_t i = 1; i < state_.size(); ++i) {
      const IoSpec* o = art_.program(prog).output(state_names_[i]);
      if (o == nullptr || o->dtype != state_[i].dtype || o->shape != state_[i].shape)
        throw RunnerError(art_.path(art_.program(prog).pte) + ": output " + state_names_[i] +
                          " must be as loss_start's");
    }
  }
  std::map<std::string, TensorRef> fin = {
      {"h", act}, {"rows", n_rows}, {"tgt", n_rows}, {"norm", ref(DType::F32, {})}};
  for (size_t i = 1; i < state_.size(); ++i) fin[state_names_[i]] = ref(state_[i]);
  bind("loss_finish", -1, fin, false);
  const IoSpec* dh = art_.program("loss_finish").output("dh");
  if (dh == nullptr || dh->dtype != act.dtype || dh->shape != act.shape)
    throw RunnerError(art_.path(art_.program("loss_finish").pte) + ": output dh must be " +
                      dtype_name(act.dtype) + shape_str(act.shape));
  const IoSpec* loss = art_.program("loss_finish").output("loss");
  if (loss == nullptr || loss->dtype != DType::F32 || loss->shape.size() != 1)
    throw RunnerError(art_.path(art_.program("loss_finish").pte) + ": output loss must be F32 (n,)");
  v0_ = HostTensor(DType::I64, {});
}

double Trainer::run_loss(int64_t n) {
  TensorRef rows = rows_of(rows_, n), tgt = rows_of(tgt_, n);
  auto keep = [&](const std::vector<TensorRef>& outs, const std::string& prog, size_t from) {
    for (size_t i = from; i < state_.size(); ++i) {
      const TensorRef& o = output(outs, prog, state_names_[i]);
      if (o.dtype != state_[i].dtype || o.shape.empty() || o.shape[0] != n ||
          o.nbytes() > state_[i].nbytes())
        throw RunnerError(prog + ": " + state_names_[i] + " came back as " + shape_str(o.shape));
      std::memcpy(state_[i].buf.data(), o.data, o.nbytes());
    }
  };
  keep(run("loss_start", -1, {{"h", ref(h_)}, {"rows", rows}}), "loss_start", 0);

  const StFile& file = art_.head_file == "head.safetensors" ? head_ : embed_;
  std::map<std::string, TensorRef> named = {{"tgt", tgt}, {"v0", ref(v0_)}};
  for (size_t i = 0; i < state_.size(); ++i) named[state_names_[i]] = rows_of(state_[i], n);
  for (int64_t v0 = 0; v0 < art_.vocab; v0 += art_.loss_chunk) {
    const int64_t width = std::min(art_.loss_chunk, art_.vocab - v0);
    const std::string prog = width == art_.loss_chunk ? "loss_slice" : "loss_tail";
    for (const char* k : kHeadKeys) {  // rows v0..v0+width of each stored head tensor
      auto t = file.header().tensors.find(art_.head_prefix + "." + k);
      if (t == file.header().tensors.end()) continue;
      Shape s = t->second.shape;
      const size_t row = static_cast<size_t>(numel(s) / s[0]) *
                         dtype_size(dtype_from_name(t->second.dtype));
      s[0] = width;
      auto* base = const_cast<uint8_t*>(file.data(t->first));
      named[std::string("head/") + k] =
          ref(dtype_from_name(t->second.dtype), s, base + static_cast<size_t>(v0) * row);
    }
    *v0_.buf.as<int64_t>() = v0;
    keep(run(prog, -1, named), prog, 1);
  }

  std::map<std::string, TensorRef> fin = {
      {"h", ref(h_)}, {"rows", rows}, {"tgt", tgt}, {"norm", ref(norm_)}};
  for (size_t i = 1; i < state_.size(); ++i) fin[state_names_[i]] = rows_of(state_[i], n);
  auto outs = run("loss_finish", -1, fin);
  const TensorRef& lr = output(outs, "loss_finish", "loss");
  if (lr.shape != Shape{n}) throw RunnerError("loss_finish: loss came back as " + shape_str(lr.shape));
  double sum = 0;
  for (int64_t r = 0; r < n; ++r) sum += static_cast<const float*>(lr.data)[r];
  copy_out(output(outs, "loss_finish", "dh"), g_, "loss_finish: dh");
  return sum;
}

}  // namespace mesp

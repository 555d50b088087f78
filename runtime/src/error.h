// Every failure the user can cause (bad artifacts, data, flags) is a RunnerError: main prints
// it as one line, "mesp-runner: error: <what>", and exits with code 2.
#pragma once

#include <stdexcept>
#include <string>

namespace mesp {

struct RunnerError : std::runtime_error {
  explicit RunnerError(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace mesp

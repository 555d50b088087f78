# Cross-compile mesp-runner for 64-bit ARM Linux (the phones' instruction set) with Debian's
# g++-aarch64-linux-gnu; scripts/build-ondevice --target aarch64 passes this file.
#
#   cmake -S runtime -B build/ondevice-aarch64 \
#         -DCMAKE_TOOLCHAIN_FILE=runtime/cmake/aarch64-linux-gnu.cmake \
#         -DEXECUTORCH_ROOT=<the manylinux_2_28_aarch64 executorch wheel, unpacked>/executorch
#
# Run the result with qemu-user: qemu-aarch64 -L /usr/aarch64-linux-gnu build/ondevice-aarch64/mesp-runner
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(MESP_CROSS_PREFIX "aarch64-linux-gnu-" CACHE STRING "cross toolchain prefix")
set(CMAKE_CXX_COMPILER "${MESP_CROSS_PREFIX}g++")
set(CMAKE_C_COMPILER "${MESP_CROSS_PREFIX}gcc")

# The cross compiler finds the target's libc and libstdc++ in its own sysroot (Debian:
# /usr/aarch64-linux-gnu). No CMAKE_FIND_ROOT_PATH: runtime/CMakeLists.txt finds the ExecuTorch
# libraries by absolute path (EXECUTORCH_ROOT/lib), which re-rooting would send into the sysroot.

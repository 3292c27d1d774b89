// cuFile and CUDA runtime plumbing for the gds op: error text, the process-wide cuFile driver session and
// device selection. Plain C++ over the C APIs (no torch), so it compiles against a CPU-only torch too.
#pragma once

#include <cuda_runtime_api.h>
#include <cufile.h>
#include <sys/types.h>

#include <cstddef>
#include <string>
#include <vector>

#include "handle_config.h"

namespace dnv::gds {

// "cuFile error 5008 (GPUDirect Storage not supported on current file)", plus the CUresult's name and text
// when cuFile reports a CUDA driver error.
std::string cufile_error_text(CUfileError_t status);
// Text for a negative return of cuFileRead/cuFileWrite other than -1 (which means: see errno).
std::string cufile_io_error_text(ssize_t ret);
std::string cuda_error_text(cudaError_t err);

// Throws UnsupportedError("<what>: CUDA error N (name: text)") unless err == cudaSuccess.
void check_cuda(cudaError_t err, const std::string& what);

// Makes `device` current on the calling thread: cuFile works in the thread's current CUDA context.
// For threads the gds op owns; a caller's thread uses DeviceGuard so that torch's current device survives.
void set_device(int device);

// Makes `device` current for a scope and restores the caller's device afterwards.
class DeviceGuard {
public:
    explicit DeviceGuard(int device);
    ~DeviceGuard();
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

private:
    int prev_ = -1;
};

// What the first handle of the process asks of cuFile. cuFile reads settings once, when its driver opens.
struct DriverSettings {
    size_t queue_depth = kDeepSpeedQueueDepth;
    unsigned parallelism = kDeepSpeedParallelism;
};

// The process's cuFile session, as cuFile describes it after cuFileDriverOpen.
struct DriverInfo {
    bool gpudirect = false;      // some storage type is served by nvidia-fs / P2P DMA, and compat is not forced
    bool compat_allowed = false;  // cuFile may fall back to its POSIX compatibility path
    bool compat_forced = false;
    unsigned nvfs_major = 0, nvfs_minor = 0;
    unsigned status_flags = 0, control_flags = 0, feature_flags = 0;
    size_t max_direct_io_size_kb = 0;
    int version = 0;               // cuFileGetVersion, 0 when unknown
    bool user_config = false;      // CUFILE_ENV_PATH_JSON was set: the user's file decides, we set nothing
    std::string log_dir;           // where cuFile may write its log (never the working directory)
    std::vector<std::string> notes;  // settings cuFile refused (kept: they only tune, never break I/O)

    const char* mode() const noexcept { return gpudirect ? "gpudirect" : "compat"; }
};

// Opens the cuFile driver once per process, thread-safe; the first caller's settings go in through
// cuFileSetParameter* (no file is written). The driver stays open until the process ends: closing it while
// another handle, or another module, still uses cuFile would break that user. A failed open is remembered
// and rethrown to every caller as UnsupportedError with cuFile's text.
const DriverInfo& open_driver(const DriverSettings& settings);

}  // namespace dnv::gds

#include "cufile_api.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>

#include "error.h"

namespace dnv::gds {
namespace {

// The CUDA driver's own error strings. libcuda is already loaded (libcufile needs it), but the extension
// links only the runtime: look the functions up instead of adding a link-time dependency on the driver.
std::string cu_result_text(CUresult r) {
    using Fn = CUresult (*)(CUresult, const char**);
    static Fn name_fn = nullptr, text_fn = nullptr;
    static std::once_flag once;
    std::call_once(once, [] {
        void* lib = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
        if (lib == nullptr) return;
        name_fn = reinterpret_cast<Fn>(::dlsym(lib, "cuGetErrorName"));
        text_fn = reinterpret_cast<Fn>(::dlsym(lib, "cuGetErrorString"));
    });
    std::string out = "CUresult " + std::to_string(static_cast<int>(r));
    const char* s = nullptr;
    if (name_fn != nullptr && name_fn(r, &s) == CUDA_SUCCESS && s != nullptr) out += std::string(" ") + s;
    s = nullptr;
    if (text_fn != nullptr && text_fn(r, &s) == CUDA_SUCCESS && s != nullptr) out += std::string(": ") + s;
    return out;
}

// A private folder for cuFile's log, which it would otherwise create in the working directory.
std::string private_log_dir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string dir = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/deepnvme-cufile-" +
                      std::to_string(::getuid());
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return {};
    struct stat st {};
    // Refuse a folder someone else made for us: it could be a trap for our log file.
    if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid()) return {};
    return dir;
}

struct DriverState {
    std::once_flag once;
    DriverInfo info;
    std::string error;  // non-empty when the driver could not be opened
};

DriverState& driver_state() {
    static DriverState s;
    return s;
}

void set_size(DriverInfo& info, CUFileSizeTConfigParameter_t p, size_t v, const char* name) {
    CUfileError_t st = cuFileSetParameterSizeT(p, v);
    if (st.err != CU_FILE_SUCCESS) info.notes.push_back(std::string(name) + "=" + std::to_string(v) +
                                                        " refused: " + cufile_error_text(st));
}

void set_bool(DriverInfo& info, CUFileBoolConfigParameter_t p, bool v, const char* name) {
    CUfileError_t st = cuFileSetParameterBool(p, v);
    if (st.err != CU_FILE_SUCCESS) info.notes.push_back(std::string(name) + " refused: " + cufile_error_text(st));
}

void open_once(DriverState& s, const DriverSettings& cfg) {
    DriverInfo& info = s.info;
    info.user_config = std::getenv("CUFILE_ENV_PATH_JSON") != nullptr;
    if (!info.user_config) {
        // Settings through the API, staged until the open below: no JSON file in the working directory.
        set_size(info, CUFILE_PARAM_EXECUTION_MAX_IO_QUEUE_DEPTH, cfg.queue_depth, "max_io_queue_depth");
        set_size(info, CUFILE_PARAM_EXECUTION_MAX_IO_THREADS, cfg.parallelism, "max_io_threads");
        set_size(info, CUFILE_PARAM_EXECUTION_MAX_REQUEST_PARALLELISM, cfg.parallelism, "max_request_parallelism");
        set_bool(info, CUFILE_PARAM_EXECUTION_PARALLEL_IO, true, "parallel_io");
        // Without nvidia-fs (or P2P DMA) cuFile then still works, through its POSIX path; get_io_mode() says so.
        set_bool(info, CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE, true, "allow_compat_mode");
    }
    if (std::getenv("CUFILE_LOGFILE_PATH") == nullptr) {
        info.log_dir = private_log_dir();
        if (!info.log_dir.empty()) {
            CUfileError_t st = cuFileSetParameterString(CUFILE_PARAM_LOG_DIR, info.log_dir.c_str());
            if (st.err != CU_FILE_SUCCESS) info.notes.push_back("log_dir refused: " + cufile_error_text(st));
        }
    }
    CUfileError_t st = cuFileDriverOpen();
    if (st.err != CU_FILE_SUCCESS) {
        s.error = "cuFileDriverOpen failed: " + cufile_error_text(st);
        return;
    }
    CUfileDrvProps_t props{};
    st = cuFileDriverGetProperties(&props);
    if (st.err != CU_FILE_SUCCESS) {
        s.error = "cuFileDriverGetProperties failed: " + cufile_error_text(st);
        return;
    }
    info.nvfs_major = props.nvfs.major_version;
    info.nvfs_minor = props.nvfs.minor_version;
    info.status_flags = props.nvfs.dstatusflags;
    info.control_flags = props.nvfs.dcontrolflags;
    info.feature_flags = props.fflags;
    info.max_direct_io_size_kb = props.nvfs.max_direct_io_size;
    info.compat_allowed = (props.nvfs.dcontrolflags & (1u << CU_FILE_ALLOW_COMPAT_MODE)) != 0;
    bool forced = false;
    if (cuFileGetParameterBool(CUFILE_PARAM_FORCE_COMPAT_MODE, &forced).err == CU_FILE_SUCCESS)
        info.compat_forced = forced;
    // dstatusflags has one bit per storage type that cuFile can drive directly (NVMe, NVMe-oF, Lustre...);
    // none set means every transfer takes the compatibility path through host memory.
    info.gpudirect = info.status_flags != 0 && !info.compat_forced;
    int version = 0;
    if (cuFileGetVersion(&version).err == CU_FILE_SUCCESS) info.version = version;
}

}  // namespace

std::string cufile_error_text(CUfileError_t status) {
    int code = static_cast<int>(status.err);
    std::string out = "cuFile error " + std::to_string(code) + " (" + cufileop_status_error(status.err) + ")";
    if (IS_CUDA_ERR(status)) out += ", CUDA driver " + cu_result_text(CU_FILE_CUDA_ERR(status));
    return out;
}

std::string cufile_io_error_text(ssize_t ret) {
    auto code = static_cast<CUfileOpError>(ret < 0 ? -ret : ret);
    return "cuFile error " + std::to_string(static_cast<long long>(code)) + " (" + cufileop_status_error(code) + ")";
}

std::string cuda_error_text(cudaError_t err) {
    return "CUDA error " + std::to_string(static_cast<int>(err)) + " (" + cudaGetErrorName(err) + ": " +
           cudaGetErrorString(err) + ")";
}

void check_cuda(cudaError_t err, const std::string& what) {
    if (err == cudaSuccess) return;
    cudaGetLastError();  // clear a non-sticky error so that the next call on this thread starts clean
    throw UnsupportedError(what + ": " + cuda_error_text(err));
}

void set_device(int device) {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current == device) return;
    check_cuda(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
}

DeviceGuard::DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
}

DeviceGuard::~DeviceGuard() {
    int now = -1;
    // Nothing to report from a destructor: a failure to switch back leaves the device the op needed.
    if (cudaGetDevice(&now) == cudaSuccess && now != prev_) static_cast<void>(cudaSetDevice(prev_));
}

const DriverInfo& open_driver(const DriverSettings& settings) {
    DriverState& s = driver_state();
    std::call_once(s.once, [&] {
        try {
            open_once(s, settings);
        } catch (const std::exception& e) {
            s.error = std::string("cuFile driver setup failed: ") + e.what();
        }
    });
    if (!s.error.empty()) throw UnsupportedError(s.error);
    return s.info;
}

}  // namespace dnv::gds

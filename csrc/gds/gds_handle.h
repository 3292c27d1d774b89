// gds_handle's engine: CUDA memory moves through cuFileRead/cuFileWrite on the handle's own worker threads
// (intra_op_parallelism of them, really in parallel); host memory goes to a dnv::IoHandle inside, the same
// engine aio_handle uses. Plain C++ over cuFile and the CUDA runtime: the binding adds torch.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cufile_api.h"
#include "file.h"
#include "handle.h"
#include "pipeline.h"
#include "verify.h"

namespace dnv::gds {

// Copies between host staging memory and device memory with cudaMemcpy, for transfers cuFile refuses
// (a file system it cannot serve): those go through the host engine instead.
class CudaCopier final : public Copier {
public:
    CudaCopier(int device, const char* ptr) : device_(device), ptr_(ptr) {}
    void to_host(void* dst, size_t offset, size_t len) const override;
    void from_host(size_t offset, const void* src, size_t len) const override;

private:
    int device_;
    const char* ptr_;
};

// One CUDA-tensor transfer through cuFile: what cuFile needs beyond every request's fields (pipeline.h).
class DeviceRequest final : public PendingRequest {
public:
    int device = 0;
    char* ptr = nullptr;           // the tensor's bytes
    const void* base = nullptr;    // what cuFile is given: the registered region's base, or ptr
    size_t buf_off = 0;            // ptr - base
    CUfileHandle_t fh = nullptr;   // cuFile's handle for file's descriptor, while the transfer runs
    std::shared_ptr<const void> lease;  // keeps a registration from being unpinned mid-transfer
    std::atomic<unsigned> chunks_left{0};

    // Reads the file range back and compares it with the device memory; "" when equal.
    std::string verify() override;
};

class GdsHandle {
public:
    // Opens the cuFile driver (once per process), the host engine and the worker threads.
    explicit GdsHandle(const HandleConfig& cfg);
    ~GdsHandle();
    GdsHandle(const GdsHandle&) = delete;
    GdsHandle& operator=(const GdsHandle&) = delete;

    struct DeviceParams {
        bool write = false;
        int device = 0;
        char* ptr = nullptr;
        size_t nbytes = 0;
        uint64_t offset = 0;
        std::string path;
        int fd = -1;  // a caller's descriptor (duplicated at submission) instead of path
        Completion completion = Completion::kCall;  // who hands it over (pipeline.h)
        bool validate = false;
        std::shared_ptr<void> keepalive;
    };

    // Opens the file, registers it with cuFile and queues the transfer; returns its id in pipeline(). Throws
    // IoError/ArgError before any I/O starts. When cuFile cannot serve the file at all, the transfer is staged
    // through host memory by the host engine instead and `warning` says so (once per file system).
    uint64_t submit_device(DeviceParams p, std::string& warning);
    // Host tensors go to host(): prepare(), then enqueue() once the binding has raised any warning.

    // The one pipeline of both sides (cuFile's requests and the host engine's): ids, wait, drain.
    Pipeline& pipeline() noexcept { return *pipeline_; }

    // The host engine itself, for the binding's prepare / warn / enqueue sequence on host tensors.
    IoHandle& host() noexcept { return *host_; }
    const HandleConfig& config() const noexcept { return host_->config(); }
    const std::string& engine_name() const noexcept { return host_->engine_name(); }
    const DriverInfo& driver() const noexcept { return driver_; }
    // CUDA-tensor requests that went through host memory because cuFile refused their file.
    uint64_t staged_requests() const noexcept { return staged_.load(std::memory_order_relaxed); }

private:
    struct Chunk {
        DeviceRequest* req;
        size_t begin, end;  // relative to the request's first byte
    };
    class Worker {
    public:
        explicit Worker(GdsHandle& h);
        ~Worker();
        Worker(const Worker&) = delete;
        Worker& operator=(const Worker&) = delete;
        void enqueue(Chunk c);

    private:
        void run();
        GdsHandle& h_;
        std::mutex mu_;
        std::condition_variable cv_;
        std::deque<Chunk> queue_;
        bool stop_ = false;
        std::thread thread_;
    };

    void run_chunk(const Chunk& c);
    void finish(DeviceRequest* r);
    uint64_t stage(DeviceParams& p, const std::string& why, uint64_t fs_device, std::string& warning);

    const DriverInfo& driver_;
    std::shared_ptr<Pipeline> pipeline_;
    std::unique_ptr<IoHandle> host_;
    std::vector<std::unique_ptr<Worker>> workers_;
    std::atomic<uint64_t> staged_{0};
    std::atomic<unsigned> next_worker_{0};
};

}  // namespace dnv::gds

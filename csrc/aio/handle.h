// io_handle: prepares a tensor transfer (opens the file, plans it) and hands its slices to worker threads,
// each feeding its own engine (worker.h), or runs a small sync one inline on the caller's thread. Its id,
// waiting and handing over are the shared request pipeline's (pipeline.h).
// Plain C++ (no torch): the binding hands it raw memory, or a Copier for memory it cannot touch directly.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"
#include "handle_config.h"
#include "pipeline.h"
#include "request.h"

namespace dnv {

class Worker;

class IoHandle {
public:
    // Requests go to `pipeline` when given (gds_handle shares one between its cuFile side and this engine),
    // else to the handle's own. `cfg` comes checked (make_config, or HandleConfig's DeepSpeed defaults).
    explicit IoHandle(const HandleConfig& cfg, std::shared_ptr<Pipeline> pipeline = nullptr);
    ~IoHandle();
    IoHandle(const IoHandle&) = delete;
    IoHandle& operator=(const IoHandle&) = delete;

    struct Params {
        bool write = false;
        char* mem = nullptr;
        std::shared_ptr<const Copier> copier;
        size_t nbytes = 0;
        uint64_t offset = 0;
        std::string path;
        int fd = -1;  // a caller's descriptor (duplicated at submission, never closed) instead of path
        Completion completion = Completion::kCall;  // who hands it over (pipeline.h)
        bool validate = false;
        std::shared_ptr<void> keepalive;
    };

    // Opens the file and plans the transfer; no I/O starts until enqueue(). Throws IoError/ArgError.
    // `warning` receives a one-time notice (e.g. O_DIRECT refused), else stays empty: the caller can raise
    // it (a warning turned into an error) and drop the request, and nothing was transferred.
    std::shared_ptr<Request> prepare(Params p, std::string& warning);
    // Queues a prepared request; returns its id. A sync request small enough to be one engine operation
    // runs here, on the calling thread, instead (call it without the GIL): a hand-off to a worker and back
    // costs two cross-thread wake-ups, more than a small transfer itself.
    uint64_t enqueue(std::shared_ptr<Request> r);
    // prepare() then enqueue().
    uint64_t submit(Params p, std::string& warning);

    // Where requests wait, are handed over and drained (see pipeline.h).
    Pipeline& pipeline() noexcept { return *pipeline_; }

    const HandleConfig& config() const noexcept { return cfg_; }
    const std::string& engine_name() const noexcept { return engine_; }

private:
    void request_done(Request* r);
    // The inline path: a sync request whose body is one engine operation runs on the caller's thread.
    bool runs_inline(const Request& r) const;
    void run_inline(Request& r, int staging, size_t run);  // staging: first buffer of its run, or -1

    HandleConfig cfg_;
    bool bypass_ok_ = false;  // the engine allows the inline path (Engine::allows_bypass)
    std::string engine_;
    std::shared_ptr<EngineShared> shared_;
    std::vector<std::unique_ptr<Worker>> workers_;
    std::shared_ptr<Pipeline> pipeline_;
    std::atomic<unsigned> next_worker_{0};
};

}  // namespace dnv

// io_handle: worker threads, each feeding its own engine; how a request is planned, moved and checked. Its id,
// waiting and handing over are the shared request pipeline's (pipeline.h).
// Plain C++ (no torch): the binding hands it raw memory, or a Copier for memory it cannot touch directly.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"
#include "file.h"
#include "pipeline.h"
#include "plan.h"
#include "staging.h"

namespace dnv {

// Moves bytes between host staging memory and memory the engine cannot address (e.g. a CUDA tensor).
// Offsets are relative to the start of the request's memory. Called on worker threads.
class Copier {
public:
    virtual ~Copier() = default;
    virtual void to_host(void* dst, size_t offset, size_t len) const = 0;      // for writes
    virtual void from_host(size_t offset, const void* src, size_t len) const = 0;  // for reads
};

struct HandleConfig {
    size_t block_size = 1 << 20;
    unsigned queue_depth = 128;
    bool single_submit = false;
    bool overlap_events = false;
    unsigned parallelism = 1;
    std::string engine = "auto";
};

class Request;

struct Slice {
    Request* req = nullptr;
    SlicePlan plan;
    size_t cursor = 0;       // next body byte to issue
    unsigned outstanding = 0;
    bool queued = false;     // in its worker's active_ list
    bool finished = false;
};

// One tensor transfer through the engine: where its memory is, how it was planned, and its slices.
class Request final : public PendingRequest {
public:
    char* mem = nullptr;                     // host memory, or null when copier is set
    std::shared_ptr<const Copier> copier;
    int body_fd = -1;
    bool direct = false;
    bool staged = false;
    std::vector<Slice> slices;
    std::atomic<unsigned> slices_left{0};

    std::string verify() override;
};

class IoHandle;

class Worker {
public:
    Worker(IoHandle& handle, std::unique_ptr<Engine> engine);
    ~Worker();
    Worker(const Worker&) = delete;
    Worker& operator=(const Worker&) = delete;
    void enqueue(Slice* slice);

private:
    struct Slot {
        Slice* slice = nullptr;
        size_t rel = 0, len = 0, done = 0;
        int staging = -1;          // first staging buffer of the op's run, or -1
        unsigned staging_n = 0;    // buffers in the run
    };
    void run();
    void fill();
    void submit_ready();
    void reap();
    void complete(uint64_t tag, int64_t res);
    void finish_slice(Slice* s);
    void maybe_finish(Slice* s);
    Slice* release_slot(unsigned tag);  // returns the slot's slice, for maybe_finish()
    IoOp op_for(unsigned tag) const;

    IoHandle& h_;
    std::unique_ptr<Engine> engine_;
    StagingArena& staging_ = StagingArena::shared();
    size_t staging_held_ = 0;        // staging buffers this worker holds
    size_t staging_bytes_held_ = 0;  // staged bytes in flight; capped by the worker_staging_bytes tunable
    size_t copied_unsubmitted_ = 0;  // staged bytes copied since the last submission (kSubmitAfterCopied)
    bool starved_ = false;           // fill() found no free staging run; wait for a release, not a timer
    uint64_t starved_epoch_ = 0;     // the arena's release count when it did
    bool fixed_tried_ = false;       // registration with the engine attempted
    bool fixed_buffers_ = false;
    std::vector<Slot> slots_;
    std::vector<unsigned> free_slots_;
    std::vector<IoOp> ready_;
    std::vector<IoDone> done_;
    std::deque<Slice*> active_;
    unsigned inflight_ = 0;

    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Slice*> incoming_;
    bool stop_ = false;
    std::thread thread_;
};

class IoHandle {
public:
    // Requests go to `pipeline` when given (gds_handle shares one between its cuFile side and this engine),
    // else to the handle's own.
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
        bool is_async = false;
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
    friend class Worker;
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

// Reads a file range back and compares it with a buffer, "" when equal, else what differs: `memory(at, len)`
// yields the buffer's bytes [at, at+len) in host memory. Every request's verify() is this.
std::string compare_with_file(const TargetFile& file, uint64_t offset, size_t nbytes, size_t chunk,
                              const std::function<const char*(size_t at, size_t len)>& memory);

}  // namespace dnv

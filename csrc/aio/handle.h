// io_handle: worker threads, each feeding its own engine; requests, their completion and their errors.
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

// One tensor transfer. Shared by the handle (until a call reports it) and every wait() that covers it; the
// last holder destroys it.
class Request {
public:
    uint64_t id = 0;
    bool write = false;
    bool is_async = false;
    bool validate = false;
    char* mem = nullptr;                     // host memory, or null when copier is set
    std::shared_ptr<const Copier> copier;
    size_t nbytes = 0;
    uint64_t offset = 0;
    TargetFile file;
    int body_fd = -1;
    bool direct = false;
    bool staged = false;
    std::vector<Slice> slices;
    std::shared_ptr<void> keepalive;          // the binding's tensor references; released by the claimer

    // First failure wins; later ones are dropped (they are usually consequences of the first).
    void fail(int err, const std::string& what);
    bool failed() const noexcept { return failed_.load(std::memory_order_relaxed); }
    int error() const noexcept { return err_; }
    const std::string& error_text() const noexcept { return err_what_; }

    std::atomic<unsigned> slices_left{0};
    bool done = false;      // guarded by the handle's mutex
    bool reported = false;  // a call has handed it over (and left the handle's pending list); same mutex

private:
    std::atomic<bool> failed_{false};
    std::mutex err_mu_;
    int err_ = 0;
    std::string err_what_;
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
        int staging = -1;
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
    unsigned staging_held_ = 0;      // staging buffers this worker holds
    size_t staging_bytes_held_ = 0;  // staged bytes in flight; capped (see handle.cpp) to keep the copies cache-warm
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
    explicit IoHandle(const HandleConfig& cfg);
    ~IoHandle();
    IoHandle(const IoHandle&) = delete;
    IoHandle& operator=(const IoHandle&) = delete;

    // Thrown by wait() when `interrupted` said stop: the requests it cancelled have finished and were handed
    // over in `out`; the caller raises whatever the interruption was (KeyboardInterrupt).
    struct Interrupted {};

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
    // Queues a prepared request; returns its id.
    uint64_t enqueue(std::shared_ptr<Request> r);
    // prepare() then enqueue().
    uint64_t submit(Params p, std::string& warning);

    // The thread contract (see README, "Guarantees"). A call covers `own` (0 for none) and every async request
    // pending when it starts, whoever submitted it; it returns once all of them have completed and hands them
    // over in `out`, returning how many it hands over:
    //  - wait() (own == 0) hands over everything it covered (another wait() covering the same requests at the
    //    same time gets them too: each raises their error);
    //  - a sync call (own != 0) hands over its own request and the covered async ones that completed cleanly;
    //    a failed async request, or one still to be validated, stays pending for a wait() to report.
    // `interrupted`, if set, is polled every kPollInterval while waiting; when it returns true the call
    // cancels (wait()) what it covers or (sync call) its own request, waits for the blocks already in flight,
    // hands the cancelled requests over and throws Interrupted; `out` then also holds references to the
    // other covered requests (still pending), for the caller to release with the GIL held and not report.
    size_t wait(uint64_t own, std::vector<std::shared_ptr<Request>>& out,
                const std::function<bool()>& interrupted = {});
    static constexpr std::chrono::milliseconds kPollInterval{50};

    // Waits for everything still pending and hands it over (for destruction). In a process forked from the
    // handle's creator it waits for nothing: the workers are the parent's.
    void drain(std::vector<std::shared_ptr<Request>>& out);

    // True in a child forked after the handle was made: it has none of the handle's threads, so the handle
    // refuses work (UnsupportedError) and its destructor leaves the parent's workers alone.
    bool inherited() const noexcept;

    const HandleConfig& config() const noexcept { return cfg_; }
    const std::string& engine_name() const noexcept { return engine_; }

private:
    friend class Worker;
    void request_done(Request* r);

    HandleConfig cfg_;
    std::string engine_;
    std::shared_ptr<EngineShared> shared_;
    std::vector<std::unique_ptr<Worker>> workers_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<std::shared_ptr<Request>> pending_;
    uint64_t next_id_ = 0;
    unsigned next_worker_ = 0;
    unsigned fork_generation_ = 0;  // forks this process had seen when the handle was made
};

// Reads the request's file range back and compares it with the memory; "" when equal, else what differs.
std::string verify_request(Request& r);

// The comparison itself: `memory(at, len)` yields the buffer's bytes [at, at+len) in host memory.
std::string compare_with_file(const TargetFile& file, uint64_t offset, size_t nbytes, size_t chunk,
                              const std::function<const char*(size_t at, size_t len)>& memory);

// The first failed request among `reqs` (submission order), or null.
const Request* first_failure(const std::vector<std::shared_ptr<Request>>& reqs);

}  // namespace dnv

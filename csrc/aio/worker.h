// One worker thread of an aio handle, feeding its own engine: it cuts its slices into engine operations
// (direct, or staged through a run of the shared staging pool), keeps up to queue_depth of them in flight,
// checks every completion (continuation.h) and moves a slice's buffered edges after its body.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine.h"
#include "handle_config.h"
#include "request.h"
#include "staging.h"
#include "staging_share.h"

namespace dnv {

class Worker {
public:
    // `request_done` is called once per request, by the worker that finishes its last slice.
    Worker(const HandleConfig& cfg, std::unique_ptr<Engine> engine, std::function<void(Request*)> request_done);
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

    const HandleConfig& cfg_;
    std::unique_ptr<Engine> engine_;
    std::function<void(Request*)> request_done_;
    StagingArena& staging_ = StagingArena::shared();
    const StagingShare share_;       // how much of staging_ this worker may hold
    size_t staging_held_ = 0;        // staging buffers this worker holds
    size_t staging_bytes_held_ = 0;  // staged bytes in flight
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

}  // namespace dnv

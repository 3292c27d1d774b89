#include "worker.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <string>

#include "bulk_copy.h"
#include "continuation.h"
#include "error.h"
#include "quiet_thread.h"
#include "transfer.h"
#include "tunables.h"

namespace dnv {
namespace {

// Staged operations are handed to the kernel as soon as this many bytes have been copied since the last
// submission (writes: copied in; reads: copied out, which frees buffers for the next): a large block's copy
// takes long enough that the device must not wait for the next, while small ones are batched, one
// submission (and one exit from a VM) per several of them.
constexpr size_t kSubmitAfterCopied = size_t(1) << 20;

// Staged writes are copied this far ahead of the queue (at least one operation, at most queue depth more):
// when a write completes, the next one is already in its buffers and goes to the kernel at once instead of
// after its copy, so a copy never stands between a completion and the device's next operation.
constexpr size_t kCopyAheadBytes = size_t(1) << 20;

}  // namespace

Worker::Worker(const HandleConfig& cfg, std::unique_ptr<Engine> engine,
               std::function<void(Request*)> request_done)
    : cfg_(cfg),
      engine_(std::move(engine)),
      request_done_(std::move(request_done)),
      share_(staging_share(staging_.buffer_bytes(), staging_.count(), tunables().worker_staging_bytes)),
      // Twice the depth: a staged read that completed keeps its slot (and buffers) until it is copied out,
      // which is after the queue has been refilled (Worker::reap); staged writes copied ahead of the queue
      // (Worker::fill) hold slots that are not in flight.
      slots_(size_t(cfg.queue_depth) * 2),
      done_(cfg.queue_depth) {
    free_slots_.reserve(slots_.size());
    for (size_t i = slots_.size(); i > 0; --i) free_slots_.push_back(static_cast<unsigned>(i - 1));
    ready_.reserve(slots_.size());
    // No asynchronous signals here: one pending on this thread can cancel its io_uring requests
    // (quiet_thread.h).
    thread_ = quiet_thread("dnv-aio-worker", [this] { run(); });
}

Worker::~Worker() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
}

void Worker::enqueue(Slice* slice) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        incoming_.push_back(slice);
    }
    cv_.notify_one();
}

void Worker::run() {
    for (;;) {
        {
            std::unique_lock<std::mutex> lock(mu_);
            if (active_.empty() && inflight_ == 0 && ready_.empty()) {
                cv_.wait(lock, [this] { return stop_ || !incoming_.empty(); });
                if (incoming_.empty()) return;  // stop requested and nothing left
            }
            while (!incoming_.empty()) {
                incoming_.front()->queued = true;
                active_.push_back(incoming_.front());
                incoming_.pop_front();
            }
        }
        starved_ = false;
        fill();
        submit_ready();
        if (inflight_ > 0) {
            reap();
        } else if (starved_ && ready_.empty()) {
            // Other workers hold the staging runs this one needs: sleep until one is released (the timeout
            // only guards against a release this worker could not see, never the normal path).
            staging_.wait_release(starved_epoch_, std::chrono::milliseconds(20));
        } else if (!ready_.empty() || !active_.empty()) {
            // Nothing in flight yet work waits: the engine refused it (EAGAIN). Give it a moment instead of
            // spinning.
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
    }
}

IoOp Worker::op_for(unsigned tag) const {
    const Slot& s = slots_[tag];
    const Request& r = *s.slice->req;
    char* buf = s.staging >= 0 ? staging_.data(s.staging) : r.mem + s.rel;
    int fixed = (fixed_buffers_ && s.staging >= 0) ? staging_.region_of(s.staging, s.staging_n) : -1;
    return IoOp{r.body_fd, buf + s.done, s.len - s.done, r.offset + s.rel + s.done, r.write, tag, fixed};
}

void Worker::fill() {
    const size_t depth = cfg_.queue_depth;
    while (!active_.empty() && !free_slots_.empty()) {
        Slice* s = active_.front();
        Request& r = *s->req;
        // A staged op below the pool's granule would take a whole buffer anyway: it moves the buffer's worth
        // of consecutive blocks instead, in one operation and one copy (per-operation costs, in the kernel
        // and the VM's device, are what a small staged block lost to a locked one).
        const size_t op_bytes = r.staged ? std::max(cfg_.block_size, staging_.buffer_bytes()) : cfg_.block_size;
        const size_t ahead = r.staged && r.write ? std::clamp<size_t>(kCopyAheadBytes / op_bytes, 1, depth) : 0;
        if (inflight_ + ready_.size() >= depth + ahead) break;
        if (r.failed() || s->cursor >= s->plan.body_end) {
            // Nothing more to issue (done, or the request failed: stop feeding it).
            s->cursor = s->plan.body_end;
            active_.pop_front();
            s->queued = false;
            maybe_finish(s);
            continue;
        }
        size_t len = std::min({op_bytes, kMaxOpBytes, s->plan.body_end - s->cursor});
        if (r.direct) {
            // O_DIRECT needs whole device blocks; the body is a whole number of them, so this never overruns.
            size_t unit = r.file.alignment().off;
            len = len < unit ? unit : len / unit * unit;
        }
        int st = -1;
        size_t run = 0;
        if (r.staged) {
            if (!fixed_tried_) {
                fixed_tried_ = true;
                try {
                    fixed_buffers_ = engine_->register_buffers(staging_.regions());
                } catch (const std::bad_alloc&) {
                    // acquire() below reports it against the request
                }
            }
            // A staged op is as long as a direct one (the block), in a run of contiguous buffers: splitting it
            // into buffer-sized ops left plain tensors at a fraction of locked ones at large blocks. The run is
            // bounded by the worker's share of the pool (staging_share.h).
            const size_t unit = r.direct ? r.file.alignment().off : 1;
            const size_t fitted = share_.op_length(len, unit);
            if (fitted == 0) {
                r.fail(EINVAL, "device alignment " + std::to_string(unit) + " exceeds the staging buffer size");
                continue;
            }
            len = fitted;
            run = share_.buffers_for(len);
            if (!share_.admits(staging_held_, staging_bytes_held_, run, len)) break;  // reap first
            try {
                st = staging_.acquire(run, &starved_epoch_);
            } catch (const std::bad_alloc&) {
                r.fail(ENOMEM, "cannot allocate staging buffers");
                continue;
            }
            if (st < 0) {
                starved_ = true;  // other workers hold the rest: reap first, or wait for a release
                break;
            }
            staging_held_ += run;
            staging_bytes_held_ += len;
        }
        unsigned tag = free_slots_.back();
        free_slots_.pop_back();
        slots_[tag] = Slot{s, s->cursor, len, 0, st, static_cast<unsigned>(run)};
        s->cursor += len;
        s->outstanding++;
        if (st >= 0 && r.write) {
            try {
                if (r.copier)
                    r.copier->to_host(staging_.data(st), slots_[tag].rel, len);
                else
                    bulk_copy(staging_.data(st), r.mem + slots_[tag].rel, len);
            } catch (const std::exception& e) {
                r.fail(EIO, std::string("copy to staging buffer failed: ") + e.what());
                release_slot(tag);
                continue;
            }
        }
        ready_.push_back(op_for(tag));
        // A staging copy takes as long as several submissions: hand copied blocks to the kernel at once, so
        // the device works while the next ones are copied (whatever overlap_events says: without it a staged
        // transfer would copy and move its bytes in turn, never both at once).
        if (st >= 0 && r.write) {
            copied_unsubmitted_ += len;
            if (copied_unsubmitted_ >= kSubmitAfterCopied) submit_ready();
        }
    }
}

void Worker::submit_ready() {
    copied_unsubmitted_ = 0;
    const size_t depth = cfg_.queue_depth;
    size_t pos = 0;
    try {
        // Never more than the queue depth in flight: the ops beyond it are staged writes copied ahead.
        while (pos < ready_.size() && inflight_ < depth) {
            size_t n = cfg_.single_submit ? 1 : std::min(ready_.size() - pos, depth - inflight_);
            size_t accepted = engine_->submit(ready_.data() + pos, n);
            if (accepted == 0) break;  // busy; retry after the next reap
            pos += accepted;
            inflight_ += static_cast<unsigned>(accepted);
        }
    } catch (const IoError& e) {
        // The engine itself broke: fail what it did not take, rather than hang waiting for it.
        for (size_t i = pos; i < ready_.size(); ++i) {
            unsigned tag = static_cast<unsigned>(ready_[i].tag);
            slots_[tag].slice->req->fail(e.err(), e.what());
            maybe_finish(release_slot(tag));
        }
        pos = ready_.size();
    }
    ready_.erase(ready_.begin(), ready_.begin() + static_cast<std::ptrdiff_t>(pos));
}

void Worker::reap() {
    // Staged blocks are reaped as soon as one completes: its copy and refill must not wait for the rest.
    bool overlap = cfg_.overlap_events || staging_held_ > 0;
    size_t min_done = overlap ? 1 : inflight_;
    size_t n;
    try {
        n = engine_->reap(done_.data(), min_done, std::min<size_t>(done_.size(), inflight_));
    } catch (const IoError& e) {
        // Cannot tell what completed: fail everything in flight instead of waiting forever.
        for (unsigned tag = 0; tag < slots_.size(); ++tag)
            if (slots_[tag].slice != nullptr) slots_[tag].slice->req->fail(e.err(), e.what());
        std::vector<unsigned> busy;
        for (unsigned tag = 0; tag < slots_.size(); ++tag)
            if (slots_[tag].slice != nullptr) busy.push_back(tag);
        inflight_ = 0;
        ready_.clear();
        for (unsigned tag : busy) maybe_finish(release_slot(tag));
        return;
    }
    inflight_ -= static_cast<unsigned>(n);
    // A staged read that completed in full is copied out of its buffers only after the queue has been
    // refilled, so the device works during the copies; and the whole batch is refilled with one submission,
    // not one per completion (each submission is a system call and, in a VM, an exit to the host). The
    // deferred completions go to the front of done_: nothing else reads it before they are handled.
    size_t deferred = 0;
    bool any_staged = false;
    for (size_t i = 0; i < n; ++i) {
        const Slot& sl = slots_[static_cast<unsigned>(done_[i].tag)];
        if (sl.staging < 0) {
            complete(done_[i].tag, done_[i].res);
            continue;
        }
        any_staged = true;
        if (!sl.slice->req->write && done_[i].res == static_cast<int64_t>(sl.len - sl.done))
            done_[deferred++] = done_[i];
        else
            complete(done_[i].tag, done_[i].res);
    }
    if (any_staged) {
        submit_ready();  // the writes copied ahead first
        fill();
        submit_ready();
    }
    // The refill above may have found the worker's staging share held by these deferred blocks: once
    // kSubmitAfterCopied bytes are copied out (and their runs freed), refill again, so that large blocks go
    // back to the device one by one and small ones in batches, as staged writes do.
    size_t copied = 0;
    for (size_t i = 0; i < deferred; ++i) {
        copied += slots_[static_cast<unsigned>(done_[i].tag)].len;
        complete(done_[i].tag, done_[i].res);
        if ((copied >= kSubmitAfterCopied || i + 1 == deferred) && inflight_ < cfg_.queue_depth) {
            copied = 0;
            fill();
            submit_ready();
        }
    }
}

void Worker::complete(uint64_t tag64, int64_t res) {
    unsigned tag = static_cast<unsigned>(tag64);
    Slot& sl = slots_[tag];
    Request& r = *sl.slice->req;
    size_t want = sl.len - sl.done;
    if (res < 0) {
        r.fail(static_cast<int>(-res), where(r, sl.rel + sl.done, want) + " failed: " +
                                           errno_text(static_cast<int>(-res)));
    } else {
        const IoOp cur = op_for(tag);
        const size_t moved = static_cast<size_t>(res);
        switch (continuation(moved, want, cur.off, reinterpret_cast<uintptr_t>(cur.buf), r.direct,
                             r.file.alignment())) {
            case Continuation::kDone:
                break;
            case Continuation::kNoProgress:
                r.fail(EIO, no_progress(r, sl.rel + sl.done, want));
                break;
            case Continuation::kSameDescriptor:
                sl.done += moved;
                ready_.push_back(op_for(tag));  // resubmit the remainder through the engine
                return;
            case Continuation::kBuffered:
                try {
                    // The rest of the op: from where its bytes stopped, in memory (request or staging) and file.
                    transfer_buffered(r, static_cast<char*>(cur.buf) + moved, sl.rel + sl.done + moved,
                                      want - moved);
                } catch (const IoError& e) {
                    r.fail(e.err(), e.what());
                }
                sl.done = sl.len;
                break;
        }
    }
    if (!r.failed() && sl.staging >= 0 && !r.write) {
        try {
            if (r.copier)
                r.copier->from_host(sl.rel, staging_.data(sl.staging), sl.len);
            else
                bulk_copy(r.mem + sl.rel, staging_.data(sl.staging), sl.len);
        } catch (const std::exception& e) {
            r.fail(EIO, std::string("copy from staging buffer failed: ") + e.what());
        }
    }
    maybe_finish(release_slot(tag));
}

Slice* Worker::release_slot(unsigned tag) {
    Slot& sl = slots_[tag];
    Slice* s = sl.slice;
    if (sl.staging >= 0) {
        staging_.release(sl.staging, sl.staging_n);
        staging_held_ -= sl.staging_n;
        staging_bytes_held_ -= sl.len;
    }
    s->outstanding--;
    sl = Slot{};
    free_slots_.push_back(tag);
    return s;
}

void Worker::maybe_finish(Slice* s) {
    if (s->finished || s->outstanding > 0 || s->cursor < s->plan.body_end) return;
    if (s->queued) return;  // still in active_: fill() finishes it when it leaves the queue
    finish_slice(s);
}

void Worker::finish_slice(Slice* s) {
    s->finished = true;
    Request& r = *s->req;
    if (!r.failed()) {
        // Edges go after the body so the page cache never races this slice's direct I/O on a shared page.
        try {
            transfer_edge(r, s->plan.head_begin, s->plan.head_end);
            transfer_edge(r, s->plan.tail_begin, s->plan.tail_end);
        } catch (const IoError& e) {
            r.fail(e.err(), e.what());
        } catch (const std::exception& e) {
            r.fail(EIO, e.what());
        }
    }
    if (r.slices_left.fetch_sub(1, std::memory_order_acq_rel) == 1) request_done_(&r);
}

}  // namespace dnv

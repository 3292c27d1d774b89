#include "handle.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>

#include "bulk_copy.h"
#include "error.h"
#include "tunables.h"

namespace dnv {
namespace {

// Longest single engine operation. io_uring takes a 32-bit length and the kernel moves at most ~2 GiB per
// read/write call, so a larger block is issued in pieces of this size (a multiple of any device alignment).
constexpr size_t kMaxOpBytes = size_t(1) << 30;

// Staged operations are handed to the kernel as soon as this many bytes have been copied since the last
// submission (writes: copied in; reads: copied out, which frees buffers for the next): a large block's copy
// takes long enough that the device must not wait for the next, while small ones are batched, one
// submission (and one exit from a VM) per several of them.
constexpr size_t kSubmitAfterCopied = size_t(1) << 20;

// Staged writes are copied this far ahead of the queue (at least one operation, at most queue depth more):
// when a write completes, the next one is already in its buffers and goes to the kernel at once instead of
// after its copy, so a copy never stands between a completion and the device's next operation.
constexpr size_t kCopyAheadBytes = size_t(1) << 20;

std::string where(const Request& r, size_t rel, size_t len) {
    return std::string(r.write ? "write" : "read") + " of " + std::to_string(len) + " bytes at file offset " +
           std::to_string(r.offset + rel);
}

// Synchronous buffered transfer of a whole range, resuming after partial transfers.
void transfer_all(Request& r, int fd, char* buf, size_t rel, size_t len) {
    size_t done = 0;
    while (done < len) {
        off_t off = static_cast<off_t>(r.offset + rel + done);
        ssize_t n = r.write ? ::pwrite(fd, buf + done, len - done, off) : ::pread(fd, buf + done, len - done, off);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw_io(errno, where(r, rel + done, len - done) + " failed", r.file.path());
        if (n == 0)
            throw IoError(EIO, "short transfer: " + where(r, rel + done, len - done) + " made no progress (end of file?)",
                          r.file.path());
        done += static_cast<size_t>(n);
    }
}

// The body of an inline request (IoHandle::run_inline) by plain system calls, under the engines' contract: a
// short transfer continues where it stopped while the rest stays aligned for O_DIRECT, else through the
// buffered descriptor (as Worker::complete does); no progress at all is an error, never success.
void transfer_body(Request& r, char* buf, size_t rel, size_t len) {
    const Alignment& a = r.file.alignment();
    size_t done = 0;
    while (done < len) {
        off_t off = static_cast<off_t>(r.offset + rel + done);
        ssize_t n = r.write ? ::pwrite(r.body_fd, buf + done, len - done, off)
                            : ::pread(r.body_fd, buf + done, len - done, off);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            int err = errno;
            throw IoError(err, where(r, rel + done, len - done) + " failed: " + errno_text(err), r.file.path());
        }
        if (n == 0)
            throw IoError(EIO, "short transfer: " + where(r, rel + done, len - done) + " made no progress (" +
                                   (r.write ? "device full?" : "file shrank?") + ")",
                          r.file.path());
        done += static_cast<size_t>(n);
        bool aligned = !r.direct || (done % a.off == 0 &&
                                     reinterpret_cast<uintptr_t>(buf + done) % (a.mem ? a.mem : 1) == 0);
        if (done < len && !aligned) {
            transfer_all(r, r.file.buffered_fd(), buf + done, rel + done, len - done);
            return;
        }
    }
}

// Device memory goes through a small host buffer; host memory is used in place.
void transfer_edge(Request& r, size_t begin, size_t end) {
    if (begin >= end) return;
    int fd = r.file.buffered_fd();
    size_t len = end - begin;
    if (!r.copier) {
        transfer_all(r, fd, r.mem + begin, begin, len);
        return;
    }
    std::vector<char> tmp(len);
    if (r.write) r.copier->to_host(tmp.data(), begin, len);
    transfer_all(r, fd, tmp.data(), begin, len);
    if (!r.write) r.copier->from_host(begin, tmp.data(), len);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Worker

Worker::Worker(IoHandle& handle, std::unique_ptr<Engine> engine)
    : h_(handle),
      engine_(std::move(engine)),
      // Twice the depth: a staged read that completed keeps its slot (and buffers) until it is copied out,
      // which is after the queue has been refilled (Worker::reap); staged writes copied ahead of the queue
      // (Worker::fill) hold slots that are not in flight.
      slots_(size_t(handle.config().queue_depth) * 2),
      done_(handle.config().queue_depth) {
    free_slots_.reserve(slots_.size());
    for (size_t i = slots_.size(); i > 0; --i) free_slots_.push_back(static_cast<unsigned>(i - 1));
    ready_.reserve(slots_.size());
    thread_ = std::thread([this] { run(); });
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
    const size_t depth = h_.config().queue_depth;
    while (!active_.empty() && !free_slots_.empty()) {
        Slice* s = active_.front();
        Request& r = *s->req;
        // A staged op below the pool's granule would take a whole buffer anyway: it moves the buffer's worth
        // of consecutive blocks instead, in one operation and one copy (per-operation costs, in the kernel
        // and the VM's device, are what a small staged block lost to a locked one).
        const size_t op_bytes =
            r.staged ? std::max(h_.config().block_size, staging_.buffer_bytes()) : h_.config().block_size;
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
            // bounded by the worker's share: half the pool (so it cannot starve the others) and the
            // worker_staging_bytes tunable (staged bytes in flight, which bounds the memory the copies touch).
            const size_t granule = staging_.buffer_bytes();
            const size_t unit = r.direct ? r.file.alignment().off : 1;
            const size_t share = std::max<size_t>(1, staging_.count() / 2);
            const size_t max_len = std::min(share * granule, std::max(granule, tunables().worker_staging_bytes));
            if (unit > max_len) {
                // No device we know needs this; refuse cleanly rather than overrun a staging run.
                r.fail(EINVAL, "device alignment " + std::to_string(unit) + " exceeds the staging buffer size");
                continue;
            }
            if (len > max_len) len = max_len / unit * unit;
            run = (len + granule - 1) / granule;
            if (staging_held_ > 0 &&
                (staging_held_ + run > share || staging_bytes_held_ + len > tunables().worker_staging_bytes))
                break;  // reap first
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
    const size_t depth = h_.config().queue_depth;
    size_t pos = 0;
    try {
        // Never more than the queue depth in flight: the ops beyond it are staged writes copied ahead.
        while (pos < ready_.size() && inflight_ < depth) {
            size_t n = h_.config().single_submit ? 1 : std::min(ready_.size() - pos, depth - inflight_);
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
    bool overlap = h_.config().overlap_events || staging_held_ > 0;
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
        if ((copied >= kSubmitAfterCopied || i + 1 == deferred) && inflight_ < h_.config().queue_depth) {
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
    } else if (static_cast<size_t>(res) < want) {
        if (res == 0) {
            r.fail(EIO, "short transfer: " + where(r, sl.rel + sl.done, want) + " made no progress (" +
                            (r.write ? "device full?" : "file shrank?") + ")");
        } else {
            sl.done += static_cast<size_t>(res);
            IoOp rest = op_for(tag);
            const Alignment& a = r.file.alignment();
            bool aligned = !r.direct || (rest.off % a.off == 0 && rest.len % a.off == 0 &&
                                         reinterpret_cast<uintptr_t>(rest.buf) % (a.mem ? a.mem : 1) == 0);
            if (aligned) {
                ready_.push_back(rest);  // resubmit the remainder through the engine
                return;
            }
            try {
                // rest.buf is where the remainder's first byte goes (the request's memory or the staging
                // buffer): transfer_all fills [buf, buf + len) from file offset r.offset + rel.
                transfer_all(r, r.file.buffered_fd(), static_cast<char*>(rest.buf), sl.rel + sl.done, rest.len);
            } catch (const IoError& e) {
                r.fail(e.err(), e.what());
            }
            sl.done = sl.len;
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
    if (r.slices_left.fetch_sub(1, std::memory_order_acq_rel) == 1) h_.request_done(&r);
}

// ---------------------------------------------------------------------------------------------------------
// IoHandle

IoHandle::IoHandle(const HandleConfig& cfg, std::shared_ptr<Pipeline> pipeline)
    : cfg_(cfg), pipeline_(pipeline ? std::move(pipeline) : std::make_shared<Pipeline>("aio handle")) {
    if (cfg.block_size == 0) throw ArgError("block_size must be positive");
    if (cfg.queue_depth == 0) throw ArgError("queue_depth must be positive");
    if (cfg.parallelism == 0) throw ArgError("intra_op_parallelism must be positive");
    engine_ = resolve_engine(cfg.engine);
    shared_ = make_engine_shared(engine_);
    // Engines are built here, on the caller's thread, so that a failure (io_setup EAGAIN...) raises now.
    std::vector<std::unique_ptr<Engine>> engines;
    for (unsigned i = 0; i < cfg.parallelism; ++i) engines.push_back(make_engine(engine_, cfg.queue_depth, shared_));
    bypass_ok_ = engines.front()->allows_bypass();
    for (auto& e : engines) workers_.push_back(std::make_unique<Worker>(*this, std::move(e)));
}

IoHandle::~IoHandle() {
    if (pipeline_->inherited()) {
        // A forked child has none of these threads: joining them would hang, destroying a joinable
        // std::thread would abort. Their memory stays with the child until it exits.
        for (auto& w : workers_) (void)w.release();
        pipeline_->abandon();  // workers may point into the requests
        return;
    }
    Handed rest;
    pipeline_->drain(rest);
    workers_.clear();  // joins the threads
}

std::shared_ptr<Request> IoHandle::prepare(Params p, std::string& warning) {
    pipeline_->refuse_if_inherited();
    auto r = std::make_shared<Request>();
    r->write = p.write;
    r->is_async = p.is_async;
    r->validate = p.validate;
    r->mem = p.mem;
    r->copier = std::move(p.copier);
    r->nbytes = p.nbytes;
    r->offset = p.offset;
    r->keepalive = std::move(p.keepalive);
    r->open_target(p.path, p.fd);
    if (r->file.o_direct_refused()) {
        // Once per file system: device and mount point (a remount is a new file system).
        std::string mount = mount_point_of(r->file.buffered_fd());
        if (first_notice("no O_DIRECT on " + std::to_string(r->file.device()) + " " + mount))
            warning = "O_DIRECT is not supported by the file system " +
                      (mount.empty() ? std::string() : "mounted at " + mount + " ") + "(first seen with " +
                      r->file.path() + "); deepnvme uses buffered I/O there: correct, but through the page cache";
    }
    r->direct = r->file.direct_fd() >= 0;
    RequestPlan plan = plan_request(reinterpret_cast<uintptr_t>(r->mem), r->nbytes, r->offset, r->direct,
                                    !r->copier, r->file.alignment(), cfg_.parallelism, tunables().min_slice_bytes);
    r->staged = plan.staged;
    r->body_fd = r->direct ? r->file.direct_fd() : r->file.buffered_fd();
    if (plan.has_edges) r->file.buffered_fd();  // open it now so a failure raises before any I/O
    r->slices.resize(plan.slices.size());
    for (size_t i = 0; i < plan.slices.size(); ++i) {
        r->slices[i].req = r.get();
        r->slices[i].plan = plan.slices[i];
        r->slices[i].cursor = plan.slices[i].body_begin;
    }
    r->slices_left.store(static_cast<unsigned>(r->slices.size()));
    return r;
}

uint64_t IoHandle::enqueue(std::shared_ptr<Request> r) {
    pipeline_->refuse_if_inherited();
    Request* raw = r.get();
    if (runs_inline(*raw)) {
        // Staged memory needs a run of the shared pool now; none free means the workers are busy with it,
        // and the request joins them rather than wait here.
        int staging = -1;
        size_t run = 0;
        if (raw->staged) {
            StagingArena& arena = StagingArena::shared();
            size_t body = raw->slices.front().plan.body_end - raw->slices.front().plan.body_begin;
            run = (body + arena.buffer_bytes() - 1) / arena.buffer_bytes();
            try {
                staging = run <= std::max<size_t>(1, arena.count() / 2) ? arena.acquire(run) : -1;
            } catch (const std::bad_alloc&) {
                staging = -1;  // the workers' path reports it against the request
            }
        }
        if (!raw->staged || staging >= 0) {
            // Pending before it runs, like any request: the call covers the async ones pending from here.
            // Only this request's own call hands a sync request over, so `r` stays alive until we return.
            uint64_t id = pipeline_->add(r, false);
            run_inline(*raw, staging, run);
            return id;
        }
    }
    // Once pending, the request can complete and be freed by another thread's wait() as soon as its last
    // slice is queued: nothing of it is read after that.
    Slice* const slices = raw->slices.data();
    const size_t nslices = raw->slices.size();
    const unsigned first_worker = next_worker_.fetch_add(static_cast<unsigned>(nslices), std::memory_order_relaxed);
    if (nslices == 0) raw->file.close();
    uint64_t id = pipeline_->add(std::move(r), nslices == 0);
    for (size_t i = 0; i < nslices; ++i) workers_[(first_worker + i) % workers_.size()]->enqueue(&slices[i]);
    return id;
}

bool IoHandle::runs_inline(const Request& r) const {
    if (!bypass_ok_ || r.is_async || r.copier || r.slices.size() != 1) return false;
    // One engine operation's worth: a worker would issue it alone too. More goes to the workers, which keep
    // several operations in flight.
    const SlicePlan& s = r.slices.front().plan;
    return s.body_end - s.body_begin <= std::min(cfg_.block_size, kMaxOpBytes);
}

void IoHandle::run_inline(Request& r, int staging, size_t run) {
    StagingArena& arena = StagingArena::shared();
    struct Lease {  // gives the staging run back however the transfer ends
        StagingArena& arena;
        int first;
        size_t n;
        ~Lease() {
            if (first >= 0) arena.release(first, n);
        }
    };
    Slice& s = r.slices.front();
    const size_t begin = s.plan.body_begin, len = s.plan.body_end - begin;
    {
        Lease lease{arena, staging, run};
        try {
            if (len > 0) {
                char* buf = staging >= 0 ? arena.data(staging) : r.mem + begin;
                if (staging >= 0 && r.write) bulk_copy(buf, r.mem + begin, len);
                transfer_body(r, buf, begin, len);
                if (staging >= 0 && !r.write) bulk_copy(r.mem + begin, buf, len);
            }
            // After the body, as on the workers (see Worker::finish_slice).
            transfer_edge(r, s.plan.head_begin, s.plan.head_end);
            transfer_edge(r, s.plan.tail_begin, s.plan.tail_end);
        } catch (const IoError& e) {
            r.fail(e.err(), e.what());
        } catch (const std::exception& e) {
            r.fail(EIO, e.what());
        }
    }
    s.cursor = s.plan.body_end;
    s.finished = true;
    r.slices_left.store(0, std::memory_order_release);
    request_done(&r);
}

uint64_t IoHandle::submit(Params p, std::string& warning) { return enqueue(prepare(std::move(p), warning)); }

void IoHandle::request_done(Request* r) {
    // Free descriptors now, not at wait(): thousands of queued files must not pile up. A caller's descriptor
    // (our duplicate of it) stays open until validation has read the file back through it.
    if (!(r->validate && r->file.user_fd() >= 0)) r->file.close();
    pipeline_->complete(r);
}

std::string compare_with_file(const TargetFile& file, uint64_t offset, size_t nbytes, size_t chunk,
                              const std::function<const char*(size_t at, size_t len)>& memory) {
    // Reopen buffered: the request's own descriptors are closed by now, and may have been O_DIRECT.
    std::string src = file.user_fd() >= 0 ? "/proc/self/fd/" + std::to_string(file.user_fd()) : file.path();
    FileDesc fd(::open(src.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) throw_io(errno, "cannot reopen for validation", file.path());
    std::vector<char> disk(std::min(chunk, nbytes));
    for (size_t at = 0; at < nbytes; at += chunk) {
        size_t len = std::min(chunk, nbytes - at);
        size_t got = 0;
        while (got < len) {
            ssize_t n = ::pread(fd.get(), disk.data() + got, len - got, static_cast<off_t>(offset + at + got));
            if (n < 0 && errno == EINTR) continue;
            if (n < 0) throw_io(errno, "validation read failed", file.path());
            if (n == 0) return "file " + file.path() + " is shorter than the buffer (" +
                               std::to_string(offset + at + got) + " bytes)";
            got += static_cast<size_t>(n);
        }
        const char* want = memory(at, len);
        if (std::memcmp(disk.data(), want, len) != 0) {
            size_t i = 0;
            while (disk[i] == want[i]) ++i;
            return "validation failed for " + file.path() + ": file byte " + std::to_string(offset + at + i) +
                   " differs from buffer byte " + std::to_string(at + i);
        }
    }
    return {};
}

std::string Request::verify() {
    constexpr size_t kChunk = 1u << 20;
    std::vector<char> host(copier ? std::min(kChunk, nbytes) : 0);
    return compare_with_file(file, offset, nbytes, kChunk, [&](size_t at, size_t len) -> const char* {
        if (!copier) return mem + at;
        copier->to_host(host.data(), at, len);
        return host.data();
    });
}

}  // namespace dnv

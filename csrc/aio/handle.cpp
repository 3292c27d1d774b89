#include "handle.h"

#include <algorithm>
#include <cerrno>
#include <new>

#include "bulk_copy.h"
#include "error.h"
#include "staging.h"
#include "staging_share.h"
#include "transfer.h"
#include "tunables.h"
#include "worker.h"

namespace dnv {

IoHandle::IoHandle(const HandleConfig& cfg, std::shared_ptr<Pipeline> pipeline)
    : cfg_(cfg), pipeline_(pipeline ? std::move(pipeline) : std::make_shared<Pipeline>("aio handle")) {
    engine_ = resolve_engine(cfg.engine);
    shared_ = make_engine_shared(engine_);
    // Engines are built here, on the caller's thread, so that a failure (io_setup EAGAIN...) raises now.
    std::vector<std::unique_ptr<Engine>> engines;
    for (unsigned i = 0; i < cfg.parallelism; ++i) engines.push_back(make_engine(engine_, cfg.queue_depth, shared_));
    bypass_ok_ = engines.front()->allows_bypass();
    for (auto& e : engines)
        workers_.push_back(std::make_unique<Worker>(cfg_, std::move(e), [this](Request* r) { request_done(r); }));
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
    r->completion = p.completion;
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
            const StagingShare share =
                staging_share(arena.buffer_bytes(), arena.count(), tunables().worker_staging_bytes);
            const size_t body = raw->slices.front().plan.body_end - raw->slices.front().plan.body_begin;
            run = share.buffers_for(body);
            try {
                staging = run <= share.max_buffers ? arena.acquire(run) : -1;
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
    if (!bypass_ok_ || r.is_async() || r.copier || r.slices.size() != 1) return false;
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

}  // namespace dnv

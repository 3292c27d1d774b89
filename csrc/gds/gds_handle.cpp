#include "gds_handle.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "device_buffers.h"
#include "error.h"
#include "quiet_thread.h"
#include "tunables.h"

namespace dnv::gds {
namespace {

// Split points between threads fall on file offsets that are multiples of this, so that two threads never
// write parts of one disk block: with O_DIRECT that would be a read-modify-write race inside cuFile.
constexpr uint64_t kSplitAlign = 4096;
// The smallest piece given to another thread and the most one cuFile call moves are the tunables
// gds_min_chunk_bytes and gds_max_call_bytes (see op_builder/tunables.py).

std::string where(const DeviceRequest& r, uint64_t rel, size_t len) {
    return std::string(r.write ? "cuFileWrite" : "cuFileRead") + " of " + std::to_string(len) +
           " bytes at file offset " + std::to_string(r.offset + rel) + " (cuda:" + std::to_string(r.device) + ")";
}

// cuFile errors that mean "not this file" rather than "broken": the host engine can still serve the file.
bool stageable(CUfileOpError e) {
    switch (e) {
        case CU_FILE_IO_NOT_SUPPORTED:
        case CU_FILE_INVALID_FILE_OPEN_FLAG:
        case CU_FILE_DIO_NOT_SET:
        case CU_FILE_INVALID_FILE_TYPE:
        case CU_FILE_IO_DISABLED:
            return true;
        default:
            return false;
    }
}

}  // namespace

void CudaCopier::to_host(void* dst, size_t offset, size_t len) const {
    set_device(device_);  // runs on the host engine's worker threads, which the gds op does not share
    check_cuda(cudaMemcpy(dst, ptr_ + offset, len, cudaMemcpyDeviceToHost), "cudaMemcpy device to host");
}

void CudaCopier::from_host(size_t offset, const void* src, size_t len) const {
    set_device(device_);
    check_cuda(cudaMemcpy(const_cast<char*>(ptr_) + offset, src, len, cudaMemcpyHostToDevice),
               "cudaMemcpy host to device");
}

// ---------------------------------------------------------------------------------------------------------
// Worker

// No asynchronous signals on this thread: they belong to Python's main thread (quiet_thread.h).
GdsHandle::Worker::Worker(GdsHandle& h) : h_(h), thread_(quiet_thread("dnv-gds-worker", [this] { run(); })) {}

GdsHandle::Worker::~Worker() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
}

void GdsHandle::Worker::enqueue(Chunk c) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back(c);
    }
    cv_.notify_one();
}

void GdsHandle::Worker::run() {
    for (;;) {
        Chunk c{};
        {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
            if (queue_.empty()) return;  // stop requested and nothing left
            c = queue_.front();
            queue_.pop_front();
        }
        h_.run_chunk(c);
    }
}

// ---------------------------------------------------------------------------------------------------------
// GdsHandle

GdsHandle::GdsHandle(const HandleConfig& cfg)
    : driver_(open_driver(DriverSettings{cfg.queue_depth, cfg.parallelism})),
      pipeline_(std::make_shared<Pipeline>("gds handle")),
      host_(std::make_unique<IoHandle>(cfg, pipeline_)) {
    for (unsigned i = 0; i < cfg.parallelism; ++i) workers_.push_back(std::make_unique<Worker>(*this));
}

GdsHandle::~GdsHandle() {
    if (pipeline_->inherited()) {
        // A forked child has none of these threads (see IoHandle::~IoHandle): leave them, and the requests
        // they may point into, alone.
        for (auto& w : workers_) (void)w.release();
        pipeline_->abandon();
        return;
    }
    Handed rest;
    pipeline_->drain(rest);
    workers_.clear();  // joins the threads
}

void GdsHandle::run_chunk(const Chunk& c) {
    DeviceRequest& r = *c.req;
    try {
        if (!r.failed()) set_device(r.device);
        size_t pos = c.begin;
        while (pos < c.end && !r.failed()) {
            size_t len = std::min(c.end - pos, tunables().gds_max_call_bytes);
            auto foff = static_cast<off_t>(r.offset + pos);
            auto boff = static_cast<off_t>(r.buf_off + pos);
            errno = 0;
            ssize_t n = r.write ? cuFileWrite(r.fh, r.base, len, foff, boff)
                                : cuFileRead(r.fh, const_cast<void*>(r.base), len, foff, boff);
            if (n == -1) {
                int err = errno != 0 ? errno : EIO;
                r.fail(err, where(r, pos, len) + " failed: " + errno_text(err));
            } else if (n < 0) {
                r.fail(EIO, where(r, pos, len) + " failed: " + cufile_io_error_text(n));
            } else if (n == 0) {
                r.fail(EIO, "short " + where(r, pos, len) + ": no progress (" +
                                (r.write ? "device full?" : "file shrank?") + ")");
            } else {
                pos += static_cast<size_t>(n);  // a short transfer: resume where it stopped
            }
        }
    } catch (const IoError& e) {
        r.fail(e.err(), e.what());
    } catch (const std::exception& e) {
        r.fail(EIO, e.what());
    }
    if (r.chunks_left.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(&r);
}

void GdsHandle::finish(DeviceRequest* r) {
    if (r->fh != nullptr) cuFileHandleDeregister(r->fh);
    r->fh = nullptr;
    // Free descriptors now, not at wait(): thousands of queued files must not pile up. A caller's descriptor
    // (our duplicate of it) stays open until validation has read the file back through it.
    if (!(r->validate && r->file.user_fd() >= 0)) r->file.close();
    r->lease.reset();
    pipeline_->complete(r);
}

uint64_t GdsHandle::stage(DeviceParams& p, const std::string& why, uint64_t fs_device, std::string& warning) {
    if (first_notice("no cuFile on " + std::to_string(fs_device)))
        warning = "cuFile cannot do I/O on the file system of " + (p.fd >= 0 ? "<fd>" : p.path) + " (" + why +
                  "); deepnvme stages CUDA tensors for it through host memory (correct, but slower)";
    IoHandle::Params h;
    h.write = p.write;
    h.copier = std::make_shared<CudaCopier>(p.device, p.ptr);
    h.nbytes = p.nbytes;
    h.offset = p.offset;
    h.path = p.path;
    h.fd = p.fd;
    h.completion = p.completion;
    h.validate = p.validate;
    h.keepalive = std::move(p.keepalive);
    std::string host_warning;
    uint64_t id = host_->submit(std::move(h), host_warning);
    if (warning.empty()) warning = host_warning;
    staged_.fetch_add(1, std::memory_order_relaxed);
    return id;
}

uint64_t GdsHandle::submit_device(DeviceParams p, std::string& warning) {
    pipeline_->refuse_if_inherited();
    if (p.nbytes > 0 && p.ptr == nullptr) throw ArgError("device buffer has no memory");
    auto r = std::make_shared<DeviceRequest>();
    r->write = p.write;
    r->completion = p.completion;
    r->validate = p.validate;
    r->device = p.device;
    r->ptr = p.ptr;
    r->nbytes = p.nbytes;
    r->offset = p.offset;
    // A descriptor of its own: each request registers it with cuFile, which refuses one already registered.
    r->open_target(p.path, p.fd, true);
    DeviceBuffers::Placement place = DeviceBuffers::instance().place(p.device, p.ptr, p.nbytes);
    r->base = place.base;
    r->buf_off = place.offset;
    r->lease = std::move(place.lease);
    r->keepalive = std::move(p.keepalive);

    std::vector<Chunk> chunks;
    if (p.nbytes > 0) {
        CUfileDescr_t desc{};
        desc.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD;
        desc.handle.fd = r->file.direct_fd() >= 0 ? r->file.direct_fd() : r->file.buffered_fd();
        CUfileError_t st{};
        {
            DeviceGuard guard(p.device);  // cuFile checks the GPU side in the current context
            st = cuFileHandleRegister(&r->fh, &desc);
        }
        if (st.err != CU_FILE_SUCCESS) {
            r->fh = nullptr;
            std::string why = "cuFileHandleRegister: " + cufile_error_text(st);
            if (stageable(st.err)) {
                uint64_t fs = r->file.device();
                r->file.close();
                p.keepalive = std::move(r->keepalive);
                return stage(p, why, fs, warning);
            }
            throw IoError(EIO, why, r->file.path());
        }
        // Cut at aligned file offsets; fewer pieces than threads when the request is small.
        size_t pieces = std::clamp<size_t>(p.nbytes / tunables().gds_min_chunk_bytes, 1, workers_.size());
        size_t per = (p.nbytes + pieces - 1) / pieces;
        size_t begin = 0;
        while (begin < p.nbytes) {
            uint64_t end_abs = p.offset + begin + per;
            end_abs = (end_abs + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
            size_t end = static_cast<size_t>(std::min<uint64_t>(end_abs - p.offset, p.nbytes));
            chunks.push_back(Chunk{r.get(), begin, end});
            begin = end;
        }
    }
    r->chunks_left.store(static_cast<unsigned>(chunks.size()));
    const unsigned first =
        next_worker_.fetch_add(static_cast<unsigned>(chunks.size()), std::memory_order_relaxed);
    if (chunks.empty()) {
        r->file.close();
        r->lease.reset();
    }
    // Once pending, the request can complete and be freed by another thread's wait(): only `chunks` is used.
    uint64_t id = pipeline_->add(std::move(r), chunks.empty());
    for (size_t i = 0; i < chunks.size(); ++i) workers_[(first + i) % workers_.size()]->enqueue(chunks[i]);
    return id;
}

std::string DeviceRequest::verify() {
    DeviceGuard guard(device);
    constexpr size_t kChunk = 4u << 20;
    std::vector<char> host(std::min(kChunk, nbytes));
    return compare_with_file(file, offset, nbytes, kChunk, [&](size_t at, size_t len) -> const char* {
        check_cuda(cudaMemcpy(host.data(), ptr + at, len, cudaMemcpyDeviceToHost), "validation cudaMemcpy");
        return host.data();
    });
}

}  // namespace dnv::gds

// io_uring engine (liburing). Fastest path; supports registered (fixed) buffers for the staging pool.
// Containers often forbid io_uring (seccomp), so availability is decided by a real round trip.
#if DEEPNVME_WITH_URING
#include <liburing.h>
#endif

#include <cerrno>
#include <sys/uio.h>
#include <vector>

#include "engine.h"
#include "engine_specs.h"
#include "error.h"

namespace dnv {

#if DEEPNVME_WITH_URING
namespace {

class UringEngine final : public Engine {
public:
    explicit UringEngine(unsigned queue_depth) {
        int rc = io_uring_queue_init(queue_depth, &ring_, 0);
        if (rc < 0) throw_io(-rc, "io_uring_queue_init failed", "");
        cqes_.resize(queue_depth * 2);
    }
    ~UringEngine() override { io_uring_queue_exit(&ring_); }

    size_t submit(const IoOp* ops, size_t n) override {
        size_t queued = 0;
        for (; queued < n; ++queued) {
            struct io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
            if (sqe == nullptr) break;
            const IoOp& op = ops[queued];
            unsigned len = static_cast<unsigned>(op.len);
            if (op.fixed_index >= 0 && op.write)
                io_uring_prep_write_fixed(sqe, op.fd, op.buf, len, op.off, op.fixed_index);
            else if (op.fixed_index >= 0)
                io_uring_prep_read_fixed(sqe, op.fd, op.buf, len, op.off, op.fixed_index);
            else if (op.write)
                io_uring_prep_write(sqe, op.fd, op.buf, len, op.off);
            else
                io_uring_prep_read(sqe, op.fd, op.buf, len, op.off);
            io_uring_sqe_set_data(sqe, reinterpret_cast<void*>(static_cast<uintptr_t>(op.tag)));
        }
        if (queued == 0) return 0;
        int rc;
        do {
            rc = io_uring_submit(&ring_);
        } while (rc == -EINTR);
        // EAGAIN/EBUSY leave the entries in the ring; the next submit or reap flushes them.
        if (rc < 0 && rc != -EAGAIN && rc != -EBUSY) throw_io(-rc, "io_uring_submit failed", "");
        return queued;
    }

    size_t reap(IoDone* out, size_t min_done, size_t max) override {
        if (max > cqes_.size()) max = cqes_.size();
        size_t n = 0;
        while (true) {
            unsigned got = io_uring_peek_batch_cqe(&ring_, cqes_.data(), static_cast<unsigned>(max - n));
            for (unsigned i = 0; i < got; ++i) out[n++] = {static_cast<uint64_t>(reinterpret_cast<uintptr_t>(io_uring_cqe_get_data(cqes_[i]))), cqes_[i]->res};
            io_uring_cq_advance(&ring_, got);
            if (n >= min_done || n >= max) return n;
            int rc = io_uring_submit_and_wait(&ring_, static_cast<unsigned>(min_done - n));
            if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && rc != -ETIME)
                throw_io(-rc, "io_uring_submit_and_wait failed", "");
        }
    }

    bool register_buffers(const std::vector<std::pair<void*, size_t>>& bufs) override {
        std::vector<struct iovec> iov;
        for (const auto& [p, len] : bufs) iov.push_back({p, len});
        return io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size())) == 0;
    }

private:
    struct io_uring ring_ {};
    std::vector<struct io_uring_cqe*> cqes_;
};

}  // namespace

std::unique_ptr<Engine> make_uring_engine(unsigned qd, const std::shared_ptr<EngineShared>&) {
    return std::make_unique<UringEngine>(qd);
}

std::string probe_uring() {
    try {
        return round_trip(std::make_unique<UringEngine>(2));
    } catch (const std::exception& e) {
        return e.what();
    }
}

#else  // built without liburing: the engine stays in the table and says why it cannot run

std::unique_ptr<Engine> make_uring_engine(unsigned, const std::shared_ptr<EngineShared>&) {
    throw UnsupportedError("engine 'io_uring' is unavailable: " + probe_uring());
}

std::string probe_uring() { return not_built_reason("liburing", "liburing-dev"); }

#endif  // DEEPNVME_WITH_URING

}  // namespace dnv

// libaio engine: Linux native AIO (io_submit/io_getevents). Real asynchrony with O_DIRECT files.
// Uses io_getevents rather than io_pgetevents so that libaio older than 0.3.111 works too.
#if DEEPNVME_WITH_LIBAIO
#include <libaio.h>
#endif

#include <cerrno>
#include <vector>

#include "engine.h"
#include "engine_specs.h"
#include "error.h"

namespace dnv {

#if DEEPNVME_WITH_LIBAIO
namespace {

class LibaioEngine final : public Engine {
public:
    explicit LibaioEngine(unsigned queue_depth) : iocbs_(queue_depth), ptrs_(queue_depth), events_(queue_depth) {
        int rc = io_setup(static_cast<int>(queue_depth), &ctx_);
        // EAGAIN here means fs.aio-max-nr is exhausted: say so rather than fail obscurely later.
        if (rc < 0)
            throw_io(-rc, "io_setup(" + std::to_string(queue_depth) + ") failed (see fs.aio-max-nr)", "");
    }
    ~LibaioEngine() override { io_destroy(ctx_); }

    size_t submit(const IoOp* ops, size_t n) override {
        if (n > iocbs_.size()) n = iocbs_.size();
        for (size_t i = 0; i < n; ++i) {
            const IoOp& op = ops[i];
            if (op.write)
                io_prep_pwrite(&iocbs_[i], op.fd, op.buf, op.len, static_cast<long long>(op.off));
            else
                io_prep_pread(&iocbs_[i], op.fd, op.buf, op.len, static_cast<long long>(op.off));
            iocbs_[i].data = reinterpret_cast<void*>(static_cast<uintptr_t>(op.tag));
            ptrs_[i] = &iocbs_[i];
        }
        int rc;
        do {
            rc = io_submit(ctx_, static_cast<long>(n), ptrs_.data());
        } while (rc == -EINTR);
        if (rc >= 0) return static_cast<size_t>(rc);
        if (rc == -EAGAIN) return 0;
        // The first op was refused outright (bad fd, misaligned direct I/O...): complete it with the error.
        rejected_.push_back({ops[0].tag, rc});
        return 1;
    }

    size_t reap(IoDone* out, size_t min_done, size_t max) override {
        size_t n = 0;
        while (!rejected_.empty() && n < max) {
            out[n++] = rejected_.back();
            rejected_.pop_back();
        }
        if (n >= min_done && n > 0) return n;
        size_t want_min = min_done > n ? min_done - n : 0;
        size_t want_max = max - n < events_.size() ? max - n : events_.size();
        if (want_max == 0) return n;
        int rc;
        do {
            rc = io_getevents(ctx_, static_cast<long>(want_min), static_cast<long>(want_max), events_.data(),
                              nullptr);
        } while (rc == -EINTR);
        if (rc < 0) throw_io(-rc, "io_getevents failed", "");
        for (int i = 0; i < rc; ++i) {
            // res is an unsigned long holding bytes or -errno.
            out[n++] = {static_cast<uint64_t>(reinterpret_cast<uintptr_t>(events_[i].data)),
                        static_cast<int64_t>(static_cast<long>(events_[i].res))};
        }
        return n;
    }

private:
    io_context_t ctx_{};
    std::vector<struct iocb> iocbs_;
    std::vector<struct iocb*> ptrs_;
    std::vector<struct io_event> events_;
    std::vector<IoDone> rejected_;
};

}  // namespace

std::unique_ptr<Engine> make_libaio_engine(unsigned qd, const std::shared_ptr<EngineShared>&) {
    return std::make_unique<LibaioEngine>(qd);
}

std::string probe_libaio() {
    try {
        return round_trip(std::make_unique<LibaioEngine>(2));
    } catch (const std::exception& e) {
        return e.what();
    }
}

#else  // built without libaio: the engine stays in the table and says why it cannot run

std::unique_ptr<Engine> make_libaio_engine(unsigned, const std::shared_ptr<EngineShared>&) {
    throw UnsupportedError("engine 'libaio' is unavailable: " + probe_libaio());
}

std::string probe_libaio() { return not_built_reason("libaio", "libaio-dev"); }

#endif  // DEEPNVME_WITH_LIBAIO

}  // namespace dnv

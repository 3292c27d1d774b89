// posix engine: plain pread/pwrite run synchronously at submit. Needs nothing but libc, so async_io
// works everywhere; parallelism comes from the handle's worker threads.
#include <unistd.h>

#include <cerrno>
#include <vector>

#include "engine.h"
#include "engine_specs.h"

namespace dnv {
namespace {

class PosixEngine final : public InlineEngine {
public:
    explicit PosixEngine(unsigned queue_depth) { done_.reserve(queue_depth); }

    size_t submit(const IoOp* ops, size_t n) override {
        for (size_t i = 0; i < n; ++i) done_.push_back({ops[i].tag, transfer_once(ops[i])});
        return n;
    }
};

}  // namespace

size_t InlineEngine::reap(IoDone* out, size_t /*min_done*/, size_t max) {
    // Everything submitted has already finished, so min_done is always met by what is here.
    size_t n = done_.size() < max ? done_.size() : max;
    for (size_t i = 0; i < n; ++i) out[i] = done_[i];
    done_.erase(done_.begin(), done_.begin() + static_cast<std::ptrdiff_t>(n));
    return n;
}

int64_t transfer_once(const IoOp& op) {
    for (;;) {
        ssize_t r = op.write ? ::pwrite(op.fd, op.buf, op.len, static_cast<off_t>(op.off))
                             : ::pread(op.fd, op.buf, op.len, static_cast<off_t>(op.off));
        if (r >= 0) return r;
        if (errno != EINTR) return -errno;
    }
}

std::unique_ptr<Engine> make_posix_engine(unsigned queue_depth, const std::shared_ptr<EngineShared>&) {
    return std::make_unique<PosixEngine>(queue_depth);
}

std::string probe_posix() { return {}; }

}  // namespace dnv

// The process-wide pool of page-aligned, locked bounce buffers, for memory that cannot go to O_DIRECT as it
// is (unaligned host memory, device memory). Allocated once on first use and shared by every handle's
// workers: never a buffer per request, and never a pool per handle (a second pool's buffers are colder in the
// cache and the TLB; bench/plain_vs_locked.py --other-stager measures it). Its size and count are tunables.
// A staged operation takes a run of contiguous buffers, so that it can be as long as the handle's block: the
// buffer size is the pool's granule, not a limit on how much one operation moves.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

namespace dnv {

class StagingArena {
public:
    // The one arena of the process. It lives until exit: workers of handles being destroyed at exit may
    // still hold buffers, so it is never torn down. Its memory is not inherited by fork(): a child starts
    // with a fresh, empty arena (the buffers the parent's workers held at fork are the parent's business,
    // and the parent's O_DIRECT transfers into them never race a copy-on-write).
    static StagingArena& shared();

    // Index of the first of `n` contiguous free buffers (taken), or -1 when no such run is free; then
    // `*epoch` (if given) receives the release count to hand to wait_release(). Allocates the arena on first
    // call (may throw std::bad_alloc).
    int acquire(size_t n, uint64_t* epoch = nullptr);
    void release(int first, size_t n);
    // Blocks until a release after `epoch` (from a failed acquire), or until `timeout`.
    void wait_release(uint64_t epoch, std::chrono::milliseconds timeout);
    char* data(int index) const { return base_ + static_cast<size_t>(index) * buffer_bytes_; }
    // A snapshot of the bookkeeping, for tests and diagnostics: every buffer is free again once no transfer
    // is in flight (before the first staged transfer, nothing is allocated and all count as free).
    struct Stats {
        size_t buffers = 0, free = 0, buffer_bytes = 0;
        bool allocated = false;
    };
    Stats stats();
    size_t buffer_bytes() const { return buffer_bytes_; }
    size_t count() const { return count_; }
    // The pool as the regions to register with an io_uring ring, each at most kMaxRegion bytes and a whole
    // number of buffers. Allocates if needed.
    std::vector<std::pair<void*, size_t>> regions();
    // Which region of regions() holds buffers [first, first + n) entirely, or -1 (the run crosses two).
    int region_of(int first, size_t n) const;
    // io_uring takes at most 1 GiB per registered buffer.
    static constexpr size_t kMaxRegion = size_t(1) << 30;

    StagingArena();  // sizes from tunables()
    StagingArena(const StagingArena&) = delete;
    StagingArena& operator=(const StagingArena&) = delete;

private:
    void allocate_locked();  // with mu_ held
    static void before_fork();
    static void after_fork_parent();
    static void after_fork_child();

    std::mutex mu_;
    std::condition_variable released_;
    uint64_t releases_ = 0;  // guarded by mu_
    size_t buffer_bytes_;
    size_t count_;
    size_t per_region_;  // buffers per registration region
    char* base_ = nullptr;
    std::vector<bool> used_;  // empty until allocated
    size_t free_ = 0;
};

}  // namespace dnv

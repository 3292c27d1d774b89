// The process-wide pool of page-aligned, locked bounce buffers, for memory that cannot go to O_DIRECT as it
// is (unaligned host memory, device memory). Allocated once on first use and shared by every handle's
// workers: never a buffer per request, and never a pool per handle (a second pool's buffers are colder in the
// cache and the TLB; bench/plain_vs_locked.py --other-stager measures it). Its size and count are tunables.
#pragma once

#include <cstddef>
#include <mutex>
#include <vector>

namespace dnv {

class StagingArena {
public:
    // The one arena of the process. It lives until exit: workers of handles being destroyed at exit may
    // still hold buffers, so it is never torn down. Its memory is not inherited by fork(): a child starts
    // with a fresh, empty arena (the buffers the parent's workers held at fork are the parent's business,
    // and the parent's O_DIRECT transfers into them never race a copy-on-write).
    static StagingArena& shared();

    // Index of a free buffer, or -1 when all are in use. Allocates the arena on first call (may throw).
    int acquire();
    void release(int index);
    char* data(int index) const { return base_ + static_cast<size_t>(index) * buffer_bytes_; }
    size_t buffer_bytes() const { return buffer_bytes_; }
    size_t count() const { return count_; }
    // Every buffer, for registration with an io_uring ring (index i is buffer i). Allocates if needed.
    std::vector<void*> buffers();

    StagingArena();  // sizes from tunables()
    StagingArena(const StagingArena&) = delete;
    StagingArena& operator=(const StagingArena&) = delete;

private:
    void allocate_locked();  // with mu_ held
    static void before_fork();
    static void after_fork_parent();
    static void after_fork_child();

    std::mutex mu_;
    size_t buffer_bytes_;
    size_t count_;
    char* base_ = nullptr;
    std::vector<int> free_;
};

}  // namespace dnv

#include "staging.h"

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <climits>
#include <limits>
#include <memory>
#include <new>

#include "tunables.h"

namespace dnv {

namespace {
StagingArena* g_arena = nullptr;
}

StagingArena::StagingArena()
    : buffer_bytes_(tunables().staging_buffer_bytes),
      count_(tunables().staging_buffers),
      per_region_(std::max<size_t>(1, kMaxRegion / tunables().staging_buffer_bytes)) {}

StagingArena& StagingArena::shared() {
    // Deliberately never destroyed (see the header): no work runs in a static destructor.
    static StagingArena* arena = [] {
        g_arena = std::make_unique<StagingArena>().release();
        ::pthread_atfork(before_fork, after_fork_parent, after_fork_child);
        return g_arena;
    }();
    return *arena;
}

// fork() copies the mutex as it is: hold it across the fork so that the child's copy is in a known state.
void StagingArena::before_fork() { g_arena->mu_.lock(); }
void StagingArena::after_fork_parent() { g_arena->mu_.unlock(); }

void StagingArena::after_fork_child() {
    // MADV_DONTFORK left the buffers out of this process: start over, allocated again on first use.
    g_arena->base_ = nullptr;
    g_arena->used_.clear();
    g_arena->free_ = 0;
    g_arena->mu_.unlock();
}

void StagingArena::allocate_locked() {
    if (base_ != nullptr) return;
    // The tunables bound both factors; checked again here because a wrapped size would map a sliver.
    if (buffer_bytes_ == 0 || count_ > static_cast<size_t>(INT_MAX) ||
        count_ > std::numeric_limits<size_t>::max() / buffer_bytes_)
        throw std::bad_alloc();
    size_t bytes = buffer_bytes_ * count_;
    // Everything that may throw comes before the mapping: a failure leaves base_ unset, so the arena stays
    // unallocated (the request fails with ENOMEM) and the next acquire() tries again.
    std::vector<bool> used(count_, false);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    base_ = static_cast<char*>(p);
    // A child process gets none of it (see after_fork_child); failing that, it would share pages under
    // the parent's transfers copy-on-write.
    (void)::madvise(base_, bytes, MADV_DONTFORK);
    // Huge pages: a staged block then costs the kernel a few page pins instead of hundreds, and the copies
    // into it fewer TLB misses. Advice only.
    (void)::madvise(base_, bytes, MADV_HUGEPAGE);
    // Locking is an optimisation (no page faults mid-transfer); an RLIMIT_MEMLOCK refusal is harmless.
    (void)::mlock(base_, bytes);
    used_.swap(used);
    free_ = count_;
}

int StagingArena::acquire(size_t n, uint64_t* epoch) {
    std::lock_guard<std::mutex> lock(mu_);
    allocate_locked();
    if (n > 0 && n <= free_) {
        // First fit: low buffers are reused most, so the ones in use stay warm in the cache and the TLB.
        size_t run = 0;
        for (size_t i = 0; i < count_; ++i) {
            run = used_[i] ? 0 : run + 1;
            if (run == n) {
                size_t first = i + 1 - n;
                for (size_t j = first; j <= i; ++j) used_[j] = true;
                free_ -= n;
                return static_cast<int>(first);
            }
        }
    }
    if (epoch != nullptr) *epoch = releases_;
    return -1;
}

void StagingArena::release(int first, size_t n) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (size_t j = 0; j < n; ++j) used_[static_cast<size_t>(first) + j] = false;
        free_ += n;
        ++releases_;
    }
    released_.notify_all();
}

void StagingArena::wait_release(uint64_t epoch, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    released_.wait_for(lock, timeout, [&] { return releases_ != epoch; });
}

StagingArena::Stats StagingArena::stats() {
    std::lock_guard<std::mutex> lock(mu_);
    const bool allocated = base_ != nullptr;
    return Stats{count_, allocated ? free_ : count_, buffer_bytes_, allocated};
}

std::vector<std::pair<void*, size_t>> StagingArena::regions() {
    std::lock_guard<std::mutex> lock(mu_);
    allocate_locked();
    std::vector<std::pair<void*, size_t>> out;
    for (size_t i = 0; i < count_; i += per_region_)
        out.emplace_back(data(static_cast<int>(i)), std::min(per_region_, count_ - i) * buffer_bytes_);
    return out;
}

int StagingArena::region_of(int first, size_t n) const {
    size_t a = static_cast<size_t>(first) / per_region_, b = (static_cast<size_t>(first) + n - 1) / per_region_;
    return a == b ? static_cast<int>(a) : -1;
}

}  // namespace dnv

#include "staging.h"

#include <pthread.h>
#include <sys/mman.h>

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
    : buffer_bytes_(tunables().staging_buffer_bytes), count_(tunables().staging_buffers) {}

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
    g_arena->free_.clear();
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
    std::vector<int> indices;
    indices.reserve(count_);
    for (size_t i = count_; i > 0; --i) indices.push_back(static_cast<int>(i - 1));
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    base_ = static_cast<char*>(p);
    // A child process gets none of it (see after_fork_child); failing that, it would share pages under
    // the parent's transfers copy-on-write.
    (void)::madvise(base_, bytes, MADV_DONTFORK);
    // Locking is an optimisation (no page faults mid-transfer); an RLIMIT_MEMLOCK refusal is harmless.
    (void)::mlock(base_, bytes);
    free_.swap(indices);
}

int StagingArena::acquire() {
    std::lock_guard<std::mutex> lock(mu_);
    allocate_locked();
    if (free_.empty()) return -1;
    int i = free_.back();
    free_.pop_back();
    return i;
}

void StagingArena::release(int index) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(index);
}

std::vector<void*> StagingArena::buffers() {
    std::lock_guard<std::mutex> lock(mu_);
    allocate_locked();
    std::vector<void*> out;
    for (size_t i = 0; i < count_; ++i) out.push_back(data(static_cast<int>(i)));
    return out;
}

}  // namespace dnv

// How much of the process-wide staging pool one transfer may hold at once, and how a staged operation is
// cut to fit: the one rule for the workers and for the inline path. Pure arithmetic, no pool, no state.
#pragma once

#include <cstddef>

namespace dnv {

struct StagingShare {
    size_t buffer_bytes = 0;  // the pool's granule
    size_t max_buffers = 0;   // contiguous buffers one holder may have: half the pool, so it cannot starve others
    size_t max_held_bytes = 0;  // staged bytes one worker may have in flight (the worker_staging_bytes tunable)

    // The longest staged operation: the share's buffers, and no more than max_held_bytes (but at least one
    // buffer, so that progress is always possible).
    size_t max_op_bytes() const noexcept;
    // Buffers a run of `bytes` occupies.
    size_t buffers_for(size_t bytes) const noexcept;
    // `len` cut to max_op_bytes() in whole `unit`s (the device's block for O_DIRECT, else 1); 0 when one unit
    // does not fit (no device we know needs that: the caller refuses the request rather than overrun a run).
    size_t op_length(size_t len, size_t unit) const noexcept;
    // Whether a holder that has `held_buffers` (and `held_bytes` in flight) may take `run` more buffers for
    // `len` bytes: always when it holds none (so that it cannot wait on itself), else within both bounds.
    bool admits(size_t held_buffers, size_t held_bytes, size_t run, size_t len) const noexcept;
};

// The share of a pool of `buffers` buffers of `buffer_bytes`, with `worker_staging_bytes` as the tunable.
StagingShare staging_share(size_t buffer_bytes, size_t buffers, size_t worker_staging_bytes) noexcept;

}  // namespace dnv

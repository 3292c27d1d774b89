// The settings of one aio handle: DeepSpeed's defaults, each setting's one limit, and the one check of a
// caller's values (make_config), which both I/O bindings (aio_handle, gds_handle) call. Read by the handle
// and by its workers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "error.h"

#if !defined(DEEPNVME_MAX_BLOCK_SIZE) || !defined(DEEPNVME_MAX_QUEUE_DEPTH) || \
    !defined(DEEPNVME_MAX_INTRA_OP_PARALLELISM)
#error "the handle settings' limits come from op_builder/tunables.py (HANDLE_LIMITS): build through the op builder"
#endif

namespace dnv {

// DeepSpeed's aio_handle defaults (its constructor's), which the binding's keyword defaults are.
constexpr int64_t kDeepSpeedBlockSize = 1 << 20;
constexpr int64_t kDeepSpeedQueueDepth = 128;
constexpr bool kDeepSpeedSingleSubmit = false;
constexpr bool kDeepSpeedOverlapEvents = false;
constexpr int64_t kDeepSpeedParallelism = 1;

// The largest value of each setting, the numbers deepnvme._core.handles.check_settings checks in Python
// (op_builder/tunables.py HANDLE_LIMITS is the one table; why each is what it is is written there).
constexpr int64_t kMaxBlockSize = DEEPNVME_MAX_BLOCK_SIZE;
constexpr int64_t kMaxQueueDepth = DEEPNVME_MAX_QUEUE_DEPTH;
constexpr int64_t kMaxParallelism = DEEPNVME_MAX_INTRA_OP_PARALLELISM;

struct HandleConfig {
    size_t block_size = kDeepSpeedBlockSize;
    unsigned queue_depth = kDeepSpeedQueueDepth;
    bool single_submit = kDeepSpeedSingleSubmit;
    bool overlap_events = kDeepSpeedOverlapEvents;
    unsigned parallelism = kDeepSpeedParallelism;
    std::string engine = "auto";
};

// `name`=`value` within 1..`maximum`, else ArgError (ValueError) naming the setting and its range.
inline void check_setting(const char* name, int64_t value, int64_t maximum) {
    if (value <= 0 || value > maximum)
        throw ArgError(std::string(name) + " must be in 1.." + std::to_string(maximum) + ", got " +
                       std::to_string(value));
}

// Handle settings as both I/O bindings take them, checked here, once, against the limits above.
inline HandleConfig make_config(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
                                int64_t parallelism, const std::string& engine) {
    check_setting("block_size", block_size, kMaxBlockSize);
    check_setting("queue_depth", queue_depth, kMaxQueueDepth);
    check_setting("intra_op_parallelism", parallelism, kMaxParallelism);
    HandleConfig c;
    c.block_size = static_cast<size_t>(block_size);
    c.queue_depth = static_cast<unsigned>(queue_depth);
    c.single_submit = single_submit;
    c.overlap_events = overlap_events;
    c.parallelism = static_cast<unsigned>(parallelism);
    c.engine = engine;
    return c;
}

}  // namespace dnv

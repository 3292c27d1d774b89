// The performance tunables of the I/O core, in one place. Defaults come from op_builder/tunables.py (as
// -DDEEPNVME_DEFAULT_<NAME>); each can be overridden by its environment variable, read once per process.
#pragma once

#include <cstddef>

namespace dnv {

// DNV_TUNABLE(field, environment variable, default define, must be a multiple of, minimum, maximum)
// The rows mirror op_builder/tunables.py; tests/test_tunables.py checks they agree.
#define DNV_TUNABLE_LIST(DNV_TUNABLE)                                                                        \
    DNV_TUNABLE(staging_buffer_bytes, "DEEPNVME_STAGING_BUFFER_BYTES", DEEPNVME_DEFAULT_STAGING_BUFFER_BYTES, \
                4096, 1, 1073741824)                                                                         \
    DNV_TUNABLE(staging_buffers, "DEEPNVME_STAGING_BUFFERS", DEEPNVME_DEFAULT_STAGING_BUFFERS, 1, 2, 65536)   \
    DNV_TUNABLE(worker_staging_bytes, "DEEPNVME_WORKER_STAGING_BYTES", DEEPNVME_DEFAULT_WORKER_STAGING_BYTES, \
                1, 1, 68719476736)                                                                           \
    DNV_TUNABLE(min_slice_bytes, "DEEPNVME_MIN_SLICE_BYTES", DEEPNVME_DEFAULT_MIN_SLICE_BYTES, 1, 1,          \
                68719476736)                                                                                 \
    DNV_TUNABLE(gds_min_chunk_bytes, "DEEPNVME_GDS_MIN_CHUNK_BYTES", DEEPNVME_DEFAULT_GDS_MIN_CHUNK_BYTES,    \
                4096, 1, 1073741824)                                                                         \
    DNV_TUNABLE(gds_max_call_bytes, "DEEPNVME_GDS_MAX_CALL_BYTES", DEEPNVME_DEFAULT_GDS_MAX_CALL_BYTES, 4096, \
                1, 2147479552)

// The staging pool (staging_buffers x staging_buffer_bytes) is one mapping: at most this many bytes.
// Mirrors STAGING_POOL_MAX_BYTES in op_builder/tunables.py.
#define DNV_STAGING_POOL_MAX_BYTES 68719476736ULL

struct Tunables {
#define DNV_TUNABLE_FIELD(field, env, def, multiple, minimum, maximum) size_t field;
    DNV_TUNABLE_LIST(DNV_TUNABLE_FIELD)
#undef DNV_TUNABLE_FIELD
};

// The values of this process: each $DEEPNVME_* over its default. Read on the first call; a malformed
// variable throws ArgError naming it (and the next call tries again).
const Tunables& tunables();

}  // namespace dnv

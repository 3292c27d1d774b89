// The performance tunables of the I/O core, in one place. Defaults come from op_builder/tunables.py (as
// -DDEEPNVME_DEFAULT_<NAME>); each can be overridden by its environment variable, read once per process.
#pragma once

#include <cstddef>
#include <functional>

namespace dnv {

// DNV_TUNABLE(field, environment variable, default define, must be a multiple of, minimum, maximum)
// The rows mirror op_builder/tunables.py; tests/aio/test_tunables.py checks they agree.
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

// The parser behind tunables(), pure so that it can be tested without a process's environment:
// `text` as $`env` holds it (null, empty or blank: `fallback`), the same rule as op_builder/tunables.py
// parse(): ASCII digits, optional K/M/G (1024-based), surrounding spaces or tabs, a value within [minimum,
// maximum] and a multiple of `multiple`. Throws ArgError naming `env` and the text.
size_t parse_tunable(const char* env, const char* text, size_t fallback, size_t multiple, size_t minimum,
                     size_t maximum);
// Every tunable as `lookup(variable name)` gives it (getenv, or a test's table), with the pool's bound.
Tunables read_tunables(const std::function<const char*(const char*)>& lookup);

}  // namespace dnv

// The settings of one aio handle, as the binding validated them: read by the handle and by its workers.
#pragma once

#include <cstddef>
#include <string>

namespace dnv {

struct HandleConfig {
    size_t block_size = 1 << 20;
    unsigned queue_depth = 128;
    bool single_submit = false;
    bool overlap_events = false;
    unsigned parallelism = 1;
    std::string engine = "auto";
};

}  // namespace dnv

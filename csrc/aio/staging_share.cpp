#include "staging_share.h"

#include <algorithm>

namespace dnv {

StagingShare staging_share(size_t buffer_bytes, size_t buffers, size_t worker_staging_bytes) noexcept {
    return StagingShare{buffer_bytes, std::max<size_t>(1, buffers / 2), worker_staging_bytes};
}

size_t StagingShare::max_op_bytes() const noexcept {
    return std::min(max_buffers * buffer_bytes, std::max(buffer_bytes, max_held_bytes));
}

size_t StagingShare::buffers_for(size_t bytes) const noexcept {
    return buffer_bytes == 0 ? 0 : (bytes + buffer_bytes - 1) / buffer_bytes;
}

size_t StagingShare::op_length(size_t len, size_t unit) const noexcept {
    const size_t max_len = max_op_bytes();
    if (unit == 0 || unit > max_len) return 0;
    return len > max_len ? max_len / unit * unit : len;
}

bool StagingShare::admits(size_t held_buffers, size_t held_bytes, size_t run, size_t len) const noexcept {
    if (held_buffers == 0) return true;
    return held_buffers + run <= max_buffers && held_bytes + len <= max_held_bytes;
}

}  // namespace dnv

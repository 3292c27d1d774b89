// The one rule for a transfer that moved fewer bytes than asked (the engines' contract, used by the workers'
// completions and by the synchronous transfers alike): the rest continues where it stopped, through the same
// descriptor while it stays aligned for O_DIRECT (file offset, length and memory), else through the buffered
// descriptor; a transfer that moved nothing is an error, never success. Pure: no I/O, no state.
#pragma once

#include <cstddef>
#include <cstdint>

#include "file.h"

namespace dnv {

enum class Continuation {
    kDone,            // everything asked for moved
    kNoProgress,      // nothing moved: fail the request (EIO), a retry would only loop
    kSameDescriptor,  // resubmit the rest as it is
    kBuffered,        // the rest lost O_DIRECT's alignment: move it through the buffered descriptor
};

// After a transfer of `want` bytes at file offset `off` from memory `buf` moved `moved` of them. `direct`:
// it went through an O_DIRECT descriptor whose rules are `align` (a buffered one takes any rest as it is).
inline Continuation continuation(size_t moved, size_t want, uint64_t off, uintptr_t buf, bool direct,
                                 const Alignment& align) noexcept {
    if (moved >= want) return Continuation::kDone;
    if (moved == 0) return Continuation::kNoProgress;
    if (!direct) return Continuation::kSameDescriptor;
    const size_t unit = align.off ? align.off : 1, mem = align.mem ? align.mem : 1;
    const bool aligned = (off + moved) % unit == 0 && (want - moved) % unit == 0 && (buf + moved) % mem == 0;
    return aligned ? Continuation::kSameDescriptor : Continuation::kBuffered;
}

}  // namespace dnv

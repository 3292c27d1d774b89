// Synchronous transfers by plain system calls, on the calling thread: the buffered edges of every request,
// the remainder of a short engine operation that lost O_DIRECT's alignment, and the body of an inline request
// (IoHandle::run_inline). Each follows the continuation rule (continuation.h) and throws IoError naming the
// file; none reports success for a short transfer.
#pragma once

#include <cstddef>
#include <string>

#include "request.h"

namespace dnv {

// "write of N bytes at file offset X": the operation, for error texts.
std::string where(const Request& r, size_t rel, size_t len);
// The error text of a transfer that moved nothing (see Continuation::kNoProgress).
std::string no_progress(const Request& r, size_t rel, size_t len);

// Moves request bytes [rel, rel + len) between `buf` and the file through the buffered descriptor.
void transfer_buffered(Request& r, char* buf, size_t rel, size_t len);
// Moves request bytes [rel, rel + len) between `buf` and the file through the body's descriptor (O_DIRECT
// when the request has it), the rest through the buffered one once a short transfer leaves it unaligned.
void transfer_body(Request& r, char* buf, size_t rel, size_t len);
// Moves the buffered edge [begin, end) of the request: host memory in place, device memory through a host
// buffer (the request's Copier).
void transfer_edge(Request& r, size_t begin, size_t end);

}  // namespace dnv

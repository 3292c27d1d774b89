// Verification after a transfer (the handles' `validate`): the file range read back and compared with the
// request's memory, wherever that memory is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "file.h"

namespace dnv {

// Reads a file range back and compares it with a buffer, "" when equal, else what differs: `memory(at, len)`
// yields the buffer's bytes [at, at+len) in host memory. Every request's verify() is this.
std::string compare_with_file(const TargetFile& file, uint64_t offset, size_t nbytes, size_t chunk,
                              const std::function<const char*(size_t at, size_t len)>& memory);

}  // namespace dnv

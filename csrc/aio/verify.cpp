#include "verify.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "error.h"
#include "request.h"

namespace dnv {

std::string compare_with_file(const TargetFile& file, uint64_t offset, size_t nbytes, size_t chunk,
                              const std::function<const char*(size_t at, size_t len)>& memory) {
    // Reopen buffered: the request's own descriptors are closed by now, and may have been O_DIRECT.
    std::string src = file.user_fd() >= 0 ? "/proc/self/fd/" + std::to_string(file.user_fd()) : file.path();
    FileDesc fd(::open(src.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) throw_io(errno, "cannot reopen for validation", file.path());
    std::vector<char> disk(std::min(chunk, nbytes));
    for (size_t at = 0; at < nbytes; at += chunk) {
        size_t len = std::min(chunk, nbytes - at);
        size_t got = 0;
        while (got < len) {
            ssize_t n = ::pread(fd.get(), disk.data() + got, len - got, static_cast<off_t>(offset + at + got));
            if (n < 0 && errno == EINTR) continue;
            if (n < 0) throw_io(errno, "validation read failed", file.path());
            if (n == 0) return "file " + file.path() + " is shorter than the buffer (" +
                               std::to_string(offset + at + got) + " bytes)";
            got += static_cast<size_t>(n);
        }
        const char* want = memory(at, len);
        if (std::memcmp(disk.data(), want, len) != 0) {
            size_t i = 0;
            while (disk[i] == want[i]) ++i;
            return "validation failed for " + file.path() + ": file byte " + std::to_string(offset + at + i) +
                   " differs from buffer byte " + std::to_string(at + i);
        }
    }
    return {};
}

std::string Request::verify() {
    constexpr size_t kChunk = 1u << 20;
    std::vector<char> host(copier ? std::min(kChunk, nbytes) : 0);
    return compare_with_file(file, offset, nbytes, kChunk, [&](size_t at, size_t len) -> const char* {
        if (!copier) return mem + at;
        copier->to_host(host.data(), at, len);
        return host.data();
    });
}

}  // namespace dnv

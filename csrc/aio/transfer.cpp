#include "transfer.h"

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <vector>

#include "continuation.h"
#include "error.h"

namespace dnv {
namespace {

// One loop for both descriptors: `fd` is direct (under `r`'s alignment) when `direct`.
void transfer_on(Request& r, int fd, bool direct, char* buf, size_t rel, size_t len) {
    size_t done = 0;
    while (done < len) {
        const uint64_t off = r.offset + rel + done;
        ssize_t n = r.write ? ::pwrite(fd, buf + done, len - done, static_cast<off_t>(off))
                            : ::pread(fd, buf + done, len - done, static_cast<off_t>(off));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            int err = errno;
            throw IoError(err, where(r, rel + done, len - done) + " failed: " + errno_text(err), r.file.path());
        }
        const size_t moved = static_cast<size_t>(n);
        switch (continuation(moved, len - done, off, reinterpret_cast<uintptr_t>(buf + done), direct,
                             r.file.alignment())) {
            case Continuation::kDone:
                return;
            case Continuation::kNoProgress:
                throw IoError(EIO, no_progress(r, rel + done, len - done), r.file.path());
            case Continuation::kSameDescriptor:
                done += moved;
                break;
            case Continuation::kBuffered:
                done += moved;
                transfer_on(r, r.file.buffered_fd(), false, buf + done, rel + done, len - done);
                return;
        }
    }
}

}  // namespace

std::string where(const Request& r, size_t rel, size_t len) {
    return std::string(r.write ? "write" : "read") + " of " + std::to_string(len) + " bytes at file offset " +
           std::to_string(r.offset + rel);
}

std::string no_progress(const Request& r, size_t rel, size_t len) {
    return "short transfer: " + where(r, rel, len) + " made no progress (" +
           (r.write ? "device full?" : "file shrank?") + ")";
}

void transfer_buffered(Request& r, char* buf, size_t rel, size_t len) {
    transfer_on(r, r.file.buffered_fd(), false, buf, rel, len);
}

void transfer_body(Request& r, char* buf, size_t rel, size_t len) {
    transfer_on(r, r.body_fd, r.direct, buf, rel, len);
}

void transfer_edge(Request& r, size_t begin, size_t end) {
    if (begin >= end) return;
    const size_t len = end - begin;
    if (!r.copier) {
        transfer_buffered(r, r.mem + begin, begin, len);
        return;
    }
    std::vector<char> tmp(len);
    if (r.write) r.copier->to_host(tmp.data(), begin, len);
    transfer_buffered(r, tmp.data(), begin, len);
    if (!r.write) r.copier->from_host(begin, tmp.data(), len);
}

}  // namespace dnv

// Files as the engine sees them: an RAII descriptor, and an opened request target that knows whether
// O_DIRECT is on and which alignment the device wants.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace dnv {

// Owns one file descriptor; closes it once.
class FileDesc {
public:
    FileDesc() = default;
    explicit FileDesc(int fd) : fd_(fd) {}
    ~FileDesc() { reset(); }
    FileDesc(FileDesc&& o) noexcept : fd_(o.release()) {}
    FileDesc& operator=(FileDesc&& o) noexcept {
        if (this != &o) {
            reset();
            fd_ = o.release();
        }
        return *this;
    }
    FileDesc(const FileDesc&) = delete;
    FileDesc& operator=(const FileDesc&) = delete;

    int get() const noexcept { return fd_; }
    explicit operator bool() const noexcept { return fd_ >= 0; }
    int release() noexcept {
        int fd = fd_;
        fd_ = -1;
        return fd;
    }
    void reset() noexcept {
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }

private:
    int fd_ = -1;
};

// The rule for "the file system refuses O_DIRECT": an open with O_DIRECT failed with one of these errors
// (EINVAL from Linux itself: ramfs, tmpfs before 6.6, FUSE or overlay over such; EOPNOTSUPP from file systems
// that check the flag in their own open: some network and FUSE ones). The file is then opened without it and
// the handle warns once per file system. deepnvme/_core/direct.py's O_DIRECT_REFUSED is the same set (a test
// holds them together); any other error is about the file and is raised.
constexpr int kODirectRefused[] = {EINVAL, EOPNOTSUPP};

constexpr bool o_direct_refused_errno(int err) noexcept {
    for (int refused : kODirectRefused)
        if (err == refused) return true;
    return false;
}

// Direct-I/O alignment rules of one file: buffer address and file offset/length granularity.
struct Alignment {
    size_t mem = 4096;
    size_t off = 4096;
};

class CallerFile;

// The file behind one request. Holds a direct descriptor when O_DIRECT is possible, and a buffered one
// for unaligned edges (opened lazily). A caller's descriptor is duplicated at submission: the caller may close
// it (and the number be reused for another file) while the request is pending. Requests by the same caller
// descriptor share one duplicate while that descriptor still holds the same file with the same flags:
// thousands of queued reads of one file must not cost thousands of descriptors.
// Only files that take positional I/O are accepted: pipes, sockets, ttys and the like raise ESPIPE.
class TargetFile {
public:
    // Opens `path` for reading or writing (created 0666 & ~umask, never truncated).
    // Throws IoError naming the path. Sets o_direct_refused() when the file system refuses O_DIRECT.
    static TargetFile open_path(const std::string& path, bool write);
    // Duplicates a caller's open descriptor (the duplicate shares its file and flags, O_DIRECT included), or,
    // when `shared`, takes the duplicate earlier requests by `fd` hold if `fd` still holds that file with
    // those flags. Not `shared` for a request that registers the descriptor with cuFile, which refuses a
    // descriptor already registered (CU_FILE_HANDLE_ALREADY_REGISTERED).
    // Throws IoError naming "<fd N>": EBADF when it is not open, EMFILE when no descriptor is left.
    static TargetFile from_fd(int fd, bool write, bool shared = true);

    TargetFile() = default;
    TargetFile(TargetFile&&) noexcept;
    TargetFile& operator=(TargetFile&&) noexcept;

    int direct_fd() const noexcept { return direct_fd_; }  // -1 if no O_DIRECT descriptor
    // A buffered descriptor for the unaligned edges: opened on first use by reopening /proc/self/fd/N
    // (for a caller's O_DIRECT descriptor too, whose flags are the caller's to keep). Throws IoError; where
    // the file's mode refuses the reopen (EACCES/EPERM), the message says to pass a descriptor without
    // O_DIRECT (used as it is, never reopened) or to align the range.
    int buffered_fd();
    const std::string& path() const noexcept { return path_; }
    const Alignment& alignment() const noexcept { return align_; }
    uint64_t size() const;                                 // current size (fstat)
    bool o_direct_refused() const noexcept { return refused_; }
    uint64_t device() const noexcept { return dev_; }
    int user_fd() const noexcept { return user_fd_; }     // our duplicate of the caller's descriptor, or -1
    // Closes our descriptors (the caller's is never ours); a shared duplicate closes with its last request.
    void close() noexcept;

private:
    int reopen_buffered() const;  // a new buffered descriptor of direct_fd_'s file, owned by the caller

    std::string path_;
    bool write_ = false;
    bool refused_ = false;
    uint64_t dev_ = 0;
    Alignment align_;
    FileDesc owned_direct_, owned_buffered_;
    int direct_fd_ = -1, buffered_fd_ = -1;
    int user_fd_ = -1;
    std::shared_ptr<CallerFile> caller_;  // set for a caller's descriptor; owns the descriptors above then
    std::mutex lazy_;
};

// Alignment for a descriptor opened with O_DIRECT: statx(STATX_DIOALIGN) where the kernel reports it,
// else the block device's logical block size, else the page size. Cached per device.
Alignment direct_alignment(int fd);

// The page size: the one alignment fresh and pinned memory use (inline: the pin_memory op, which has no
// file.cpp, asks too).
inline size_t page_size() noexcept {
    long p = ::sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : 4096;
}

// Mount point of the file system holding fd ("" if unknown); names a file system better than st_dev,
// which a new mount can reuse.
std::string mount_point_of(int fd);

}  // namespace dnv

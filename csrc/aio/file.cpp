#include "file.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <utility>
#include <vector>

#include "error.h"

namespace dnv {
namespace {

int open_retry(const char* path, int flags, mode_t mode) {
    int fd;
    do {
        fd = ::open(path, flags, mode);
    } while (fd < 0 && errno == EINTR);
    return fd;
}

size_t read_sysfs_size(const std::string& file) {
    std::ifstream in(file);
    size_t v = 0;
    if (in >> v) return v;
    return 0;
}

// Logical block size of the device holding the file; 0 if unknown (not a block device: tmpfs, overlay...).
size_t logical_block_size(dev_t dev) {
    std::string base = "/sys/dev/block/" + std::to_string(major(dev)) + ":" + std::to_string(minor(dev));
    size_t v = read_sysfs_size(base + "/queue/logical_block_size");
    if (v == 0) v = read_sysfs_size(base + "/../queue/logical_block_size");  // a partition: ask its disk
    return v;
}

// Refuses files without positional I/O (FIFOs, sockets, ttys...): offsets would be ignored and blocks
// land out of order. For character devices lseek's ESPIPE is the kernel's own verdict on that (regular
// files and block devices always take offsets: no system call for them).
void require_positional(int fd, const struct stat& st, const std::string& path) {
    if (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) ||
        (S_ISCHR(st.st_mode) && ::lseek(fd, 0, SEEK_CUR) < 0 && errno == ESPIPE))
        throw IoError(ESPIPE, "not a file that takes positional I/O (a pipe, socket or terminal?): " +
                                  errno_text(ESPIPE), path);
}

struct AlignCache {
    std::mutex mu;
    std::vector<std::pair<dev_t, Alignment>> entries;
};

AlignCache& align_cache() {
    static AlignCache cache;
    return cache;
}

}  // namespace

std::string mount_point_of(int fd) {
    struct statx sx {};
    if (::statx(fd, "", AT_EMPTY_PATH, STATX_MNT_ID, &sx) != 0 || !(sx.stx_mask & STATX_MNT_ID)) return {};
    std::ifstream in("/proc/self/mountinfo");
    std::string line;
    while (std::getline(in, line)) {
        // "<mount id> <parent id> <major:minor> <root> <mount point> ..."
        size_t sp = line.find(' ');
        if (sp == std::string::npos || line.compare(0, sp, std::to_string(sx.stx_mnt_id)) != 0) continue;
        size_t a = sp;
        for (int field = 0; field < 3 && a != std::string::npos; ++field) a = line.find(' ', a + 1);
        if (a == std::string::npos) return {};
        size_t b = line.find(' ', a + 1);
        return line.substr(a + 1, b == std::string::npos ? std::string::npos : b - a - 1);
    }
    return {};
}

size_t page_size() noexcept {
    long p = ::sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : 4096;
}

Alignment direct_alignment(int fd) {
    Alignment a;
    struct statx sx {};
    if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
        sx.stx_dio_offset_align != 0) {
        a.mem = sx.stx_dio_mem_align;
        a.off = sx.stx_dio_offset_align;
        return a;
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) return a;
    AlignCache& cache = align_cache();
    std::lock_guard<std::mutex> lock(cache.mu);
    for (const auto& [dev, known] : cache.entries)
        if (dev == st.st_dev) return known;
    size_t lbs = logical_block_size(st.st_dev);
    if (lbs != 0) a.mem = a.off = lbs;  // else keep the page size: safe for every device we know
    cache.entries.emplace_back(st.st_dev, a);
    return a;
}

TargetFile::TargetFile(TargetFile&& o) noexcept { *this = std::move(o); }

TargetFile& TargetFile::operator=(TargetFile&& o) noexcept {
    if (this == &o) return *this;
    path_ = std::move(o.path_);
    write_ = o.write_;
    refused_ = o.refused_;
    dev_ = o.dev_;
    align_ = o.align_;
    owned_direct_ = std::move(o.owned_direct_);
    owned_buffered_ = std::move(o.owned_buffered_);
    direct_fd_ = std::exchange(o.direct_fd_, -1);
    buffered_fd_ = std::exchange(o.buffered_fd_, -1);
    user_fd_ = std::exchange(o.user_fd_, -1);
    return *this;
}

TargetFile TargetFile::open_path(const std::string& path, bool write) {
    TargetFile f;
    f.path_ = path;
    f.write_ = write;
    if (path.find('\0') != std::string::npos) throw ArgError("file name contains a NUL byte");
    std::string action = std::string("cannot open for ") + (write ? "writing" : "reading");
    // O_NONBLOCK: a FIFO would block open() until a peer came (and ignore Ctrl-C); it is refused below anyway.
    int base = (write ? O_WRONLY | O_CREAT : O_RDONLY) | O_CLOEXEC | O_NONBLOCK;
    int fd = open_retry(path.c_str(), base | O_DIRECT, 0666);
    if (fd < 0 && errno == EINVAL) {
        // The file system refuses O_DIRECT (ramfs, some FUSE/overlay setups): fall back to buffered I/O.
        fd = open_retry(path.c_str(), base, 0666);
        if (fd >= 0) {
            f.refused_ = true;
            f.owned_buffered_ = FileDesc(fd);
            f.buffered_fd_ = fd;
        }
    } else if (fd >= 0) {
        f.owned_direct_ = FileDesc(fd);
        f.direct_fd_ = fd;
    }
    struct stat st {};
    if (fd < 0) {
        int err = errno;
        // A FIFO without a reader (ENXIO for a writer) or a socket: say what is really wrong.
        if (err == ENXIO && ::stat(path.c_str(), &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode)))
            err = ESPIPE;
        throw_io(err, err == ESPIPE ? "not a file that takes positional I/O (a pipe or socket)" : action, path);
    }
    if (::fstat(fd, &st) != 0) throw_io(errno, "fstat failed", path);
    if (S_ISDIR(st.st_mode)) throw IoError(EISDIR, "is a directory: " + errno_text(EISDIR), path);
    require_positional(fd, st, path);
    // Back to blocking mode: io_uring would otherwise end reads and writes with EAGAIN instead of waiting.
    if (::fcntl(fd, F_SETFL, (f.refused_ ? 0 : O_DIRECT)) != 0) throw_io(errno, "fcntl(F_SETFL) failed", path);
    f.dev_ = st.st_dev;
    if (f.direct_fd_ >= 0) f.align_ = direct_alignment(f.direct_fd_);
    return f;
}

TargetFile TargetFile::from_fd(int fd, bool write) {
    TargetFile f;
    f.path_ = "<fd " + std::to_string(fd) + ">";
    f.write_ = write;
    int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) {
        int err = errno;
        // EMFILE/ENFILE: the descriptor is fine, the process (or system) has none left for the duplicate.
        throw_io(err, err == EBADF ? "not an open file descriptor" : "cannot duplicate the descriptor", f.path_);
    }
    FileDesc owned(dup);
    int flags = ::fcntl(dup, F_GETFL);
    if (flags < 0) throw_io(errno, "not an open file descriptor", f.path_);
    struct stat st {};
    if (::fstat(dup, &st) != 0) throw_io(errno, "fstat failed", f.path_);
    if (S_ISDIR(st.st_mode)) throw IoError(EISDIR, "is a directory: " + errno_text(EISDIR), f.path_);
    require_positional(dup, st, f.path_);
    f.dev_ = st.st_dev;
    f.user_fd_ = dup;
    if (flags & O_DIRECT) {
        f.owned_direct_ = std::move(owned);
        f.direct_fd_ = dup;
        f.align_ = direct_alignment(dup);
    } else {
        // The caller's descriptor is buffered: use it for everything rather than reopening behind its back.
        f.owned_buffered_ = std::move(owned);
        f.buffered_fd_ = dup;
    }
    return f;
}

int TargetFile::buffered_fd() {
    std::lock_guard<std::mutex> lock(lazy_);
    if (buffered_fd_ >= 0) return buffered_fd_;
    // Reopen the same file without O_DIRECT for the unaligned edges. /proc/self/fd works for a caller's
    // descriptor too, whatever its path was.
    int src = direct_fd_;
    int flags = (write_ ? O_WRONLY : O_RDONLY) | O_CLOEXEC;
    std::string proc = "/proc/self/fd/" + std::to_string(src);
    int fd = open_retry(proc.c_str(), flags, 0);
    if (fd < 0 && user_fd_ >= 0 && (errno == EACCES || errno == EPERM)) {
        // The caller's O_DIRECT descriptor cannot write unaligned bytes, and its file description's flags
        // are the caller's (clearing O_DIRECT there would change their descriptor under them): the only
        // buffered way in is a reopen, which the file's mode refuses now. Say what works instead.
        int err = errno;
        throw_io(err,
                 std::string("the descriptor was opened with O_DIRECT and the unaligned start or end of this "
                             "range needs a buffered descriptor of the same file, but reopening it (through "
                             "/proc/self/fd) for ") +
                     (write_ ? "writing" : "reading") +
                     " is refused (the file's mode no longer allows it): pass a descriptor opened without "
                     "O_DIRECT, or align the offset and length to " + std::to_string(align_.off) + " bytes",
                 path_);
    }
    if (fd < 0) throw_io(errno, "cannot reopen without O_DIRECT for unaligned edges", path_);
    owned_buffered_ = FileDesc(fd);
    buffered_fd_ = fd;
    return fd;
}

uint64_t TargetFile::size() const {
    int fd = direct_fd_ >= 0 ? direct_fd_ : buffered_fd_;
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw_io(errno, "fstat failed", path_);
    if (S_ISBLK(st.st_mode)) {
        // A block device reports st_size 0; its capacity comes from the driver.
        uint64_t bytes = 0;
        if (::ioctl(fd, BLKGETSIZE64, &bytes) != 0) throw_io(errno, "BLKGETSIZE64 failed", path_);
        return bytes;
    }
    return static_cast<uint64_t>(st.st_size);
}

void TargetFile::close() noexcept {
    owned_direct_.reset();
    owned_buffered_.reset();
    direct_fd_ = buffered_fd_ = user_fd_ = -1;
}

}  // namespace dnv

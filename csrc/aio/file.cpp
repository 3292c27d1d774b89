#include "file.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <unordered_map>
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

// One duplicate of a caller's descriptor, shared by the requests addressed by that descriptor while it holds
// the same file with the same flags. The duplicate pins its file: while it is open no other file on that
// device can get its inode number, so a caller's descriptor showing the same (st_dev, st_ino) and F_GETFL
// flags holds the same file, opened the same way, and positional I/O through either reaches the same bytes.
// A descriptor closed and reused for another file shows another inode, and gets a duplicate of its own.
class CallerFile {
public:
    // The duplicate requests by `fd` share now; `name` ("<fd N>") names it in errors.
    static std::shared_ptr<CallerFile> share(int fd, const std::string& name);
    // A new duplicate of `fd`, shared with no one else yet.
    static std::shared_ptr<CallerFile> duplicate(int fd, const std::string& name);

    CallerFile(FileDesc dup, const struct stat& st, int flags)
        : dup_(std::move(dup)), dev_(st.st_dev), ino_(st.st_ino), flags_(flags) {
        if (direct()) align_ = direct_alignment(dup_.get());
    }

    int fd() const noexcept { return dup_.get(); }
    bool direct() const noexcept { return (flags_ & O_DIRECT) != 0; }
    bool appends() const noexcept { return (flags_ & O_APPEND) != 0; }
    uint64_t device() const noexcept { return dev_; }
    const Alignment& alignment() const noexcept { return align_; }
    bool holds(const struct stat& st, int flags) const noexcept {
        return st.st_dev == dev_ && st.st_ino == ino_ && flags == flags_;
    }
    // The buffered reopen of an O_DIRECT duplicate for unaligned edges, one per direction, made by `reopen`
    // (which returns a new descriptor or throws) on first use.
    template <class Reopen>
    int buffered(bool write, Reopen&& reopen) {
        std::lock_guard<std::mutex> lock(mu_);
        FileDesc& fd = reopened_[write ? 1 : 0];
        if (!fd) fd = FileDesc(reopen());
        return fd.get();
    }

private:
    FileDesc dup_;
    dev_t dev_;
    ino_t ino_;
    int flags_;
    Alignment align_;
    std::mutex mu_;
    FileDesc reopened_[2];
};

namespace {

// The shared duplicates by caller descriptor number. Weak: a duplicate closes with the last request holding
// it; expired entries are swept when the table has doubled since the last sweep.
struct DupCache {
    std::mutex mu;
    std::unordered_map<int, std::weak_ptr<CallerFile>> by_fd;
    size_t sweep_at = 64;
};

DupCache* g_dup_cache = nullptr;

DupCache& dup_cache() {
    static std::once_flag once;
    std::call_once(once, [] {
        // Never destroyed: a thread the interpreter left running may still submit while the process exits.
        g_dup_cache = new DupCache;
        // Held across fork(), so that the child's copy is consistent and unlocked. The child starts empty:
        // it may close the inherited duplicates (and reuse their numbers for other files), so they are no
        // longer ours to share there; its handles make their own.
        ::pthread_atfork([] { g_dup_cache->mu.lock(); }, [] { g_dup_cache->mu.unlock(); },
                         [] {
                             g_dup_cache->by_fd.clear();
                             g_dup_cache->sweep_at = 64;
                             g_dup_cache->mu.unlock();
                         });
    });
    return *g_dup_cache;
}

}  // namespace

std::shared_ptr<CallerFile> CallerFile::share(int fd, const std::string& name) {
    int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0) throw_io(errno, "not an open file descriptor", name);
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw_io(errno, "fstat failed", name);
    DupCache& cache = dup_cache();
    std::shared_ptr<CallerFile> other;  // another file's duplicate: released after the lock (it may close)
    {
        std::lock_guard<std::mutex> lock(cache.mu);
        auto it = cache.by_fd.find(fd);
        if (it != cache.by_fd.end()) {
            other = it->second.lock();
            if (other && other->holds(st, flags)) return other;
        }
    }
    auto made = duplicate(fd, name);
    std::lock_guard<std::mutex> lock(cache.mu);
    cache.by_fd[fd] = made;
    if (cache.by_fd.size() >= cache.sweep_at) {
        for (auto at = cache.by_fd.begin(); at != cache.by_fd.end();)
            at = at->second.expired() ? cache.by_fd.erase(at) : std::next(at);
        cache.sweep_at = std::max<size_t>(64, 2 * cache.by_fd.size());
    }
    return made;
}

std::shared_ptr<CallerFile> CallerFile::duplicate(int fd, const std::string& name) {
    // What the duplicate says is authoritative: the caller may reuse the number at any time.
    int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) {
        int err = errno;
        // EMFILE/ENFILE: the descriptor is fine, the process (or system) has none left for the duplicate.
        throw_io(err, err == EBADF ? "not an open file descriptor" : "cannot duplicate the descriptor", name);
    }
    FileDesc owned(dup);
    int flags = ::fcntl(dup, F_GETFL);
    if (flags < 0) throw_io(errno, "not an open file descriptor", name);
    struct stat st {};
    if (::fstat(dup, &st) != 0) throw_io(errno, "fstat failed", name);
    if (S_ISDIR(st.st_mode)) throw IoError(EISDIR, "is a directory: " + errno_text(EISDIR), name);
    require_positional(dup, st, name);
    return std::make_shared<CallerFile>(std::move(owned), st, flags);
}

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
    caller_ = std::move(o.caller_);
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
    if (fd < 0 && o_direct_refused_errno(errno)) {
        // The file system refuses O_DIRECT (file.h's rule): fall back to buffered I/O; the handle warns.
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

TargetFile TargetFile::from_fd(int fd, bool write, bool shared) {
    TargetFile f;
    f.path_ = "<fd " + std::to_string(fd) + ">";
    f.write_ = write;
    f.caller_ = shared ? CallerFile::share(fd, f.path_) : CallerFile::duplicate(fd, f.path_);
    const CallerFile& caller = *f.caller_;
    // Linux ignores pwrite's offset on an O_APPEND descriptor: every block would land at the end of the file,
    // in whatever order the blocks finish, and the call would report success.
    if (write && caller.appends())
        throw IoError(EINVAL,
                      "opened with O_APPEND: positional writes through it would land at the end of the file, "
                      "not at file_offset; pass a descriptor opened without O_APPEND (or the file's path)",
                      f.path_);
    f.dev_ = caller.device();
    f.user_fd_ = caller.fd();
    if (caller.direct()) {
        f.direct_fd_ = caller.fd();
        f.align_ = caller.alignment();
    } else {
        // The caller's descriptor is buffered: use it for everything rather than reopening behind its back.
        f.buffered_fd_ = caller.fd();
    }
    return f;
}

int TargetFile::reopen_buffered() const {
    // Reopen the same file without O_DIRECT for the unaligned edges. /proc/self/fd works for a caller's
    // descriptor too, whatever its path was.
    int flags = (write_ ? O_WRONLY : O_RDONLY) | O_CLOEXEC;
    std::string proc = "/proc/self/fd/" + std::to_string(direct_fd_);
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
    return fd;
}

int TargetFile::buffered_fd() {
    std::lock_guard<std::mutex> lock(lazy_);
    if (buffered_fd_ >= 0) return buffered_fd_;
    if (caller_) {
        // One reopen per shared duplicate, not per request: the requests of one descriptor hold one file.
        buffered_fd_ = caller_->buffered(write_, [this] { return reopen_buffered(); });
    } else {
        owned_buffered_ = FileDesc(reopen_buffered());
        buffered_fd_ = owned_buffered_.get();
    }
    return buffered_fd_;
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
    caller_.reset();
    direct_fd_ = buffered_fd_ = user_fd_ = -1;
}

}  // namespace dnv

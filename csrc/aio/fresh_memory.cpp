#include "fresh_memory.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <utility>

#include "bulk_copy.h"
#include "error.h"
#include "file.h"

#if defined(__linux__) && __has_include(<linux/userfaultfd.h>)
#include <linux/userfaultfd.h>
#define DNV_HAVE_UFFD 1
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1  // Linux 5.11+: unprivileged, for faults from user mode only
#endif
#else
#define DNV_HAVE_UFFD 0
#endif

namespace dnv {
namespace {

uintptr_t round_up(uintptr_t v, size_t a) { return (v + a - 1) / a * a; }
uintptr_t round_down(uintptr_t v, size_t a) { return v / a * a; }

#if DNV_HAVE_UFFD

// The environment variable that turns fresh filling off ("0"): for a seccomp filter that kills a process
// calling userfaultfd(2) instead of refusing it, which no probe survives.
constexpr const char* kSwitch = "DEEPNVME_FILL_FRESH";

// The process's userfaultfd, why there is none, and which process generation it belongs to. Never destroyed
// (no work runs in a static destructor). A failure for want of resources (descriptors, memory, a thread) is
// tried again at the next block; one that will not change (no permission, no kernel support) is final.
// fork() hands the child the descriptor's number, whose ioctls would act on the parent's memory, but not the
// thread that serves it: the child closes it at once (pthread_atfork, before anything can reuse the number),
// starts a new generation, and opens its own on first use.
// Which open file a descriptor names: a descriptor number can be closed by other code and reused.
struct FileId {
    dev_t dev = 0;
    ino_t ino = 0;
    bool operator==(const FileId& o) const noexcept { return dev == o.dev && ino == o.ino; }
};

FileId file_id(int fd) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return {};
    return {st.st_dev, st.st_ino};
}

struct UffdState {
    std::mutex mu;
    bool tried = false;
    int fd = -1;
    FileId id;  // what fd named when it was opened
    unsigned long generation = 1;  // blocks armed in another generation are plain memory here
    std::string why;
};

UffdState& state() {
    static UffdState* s = [] {
        auto* st = new UffdState;
        ::pthread_atfork([] { state().mu.lock(); }, [] { state().mu.unlock(); },
                         [] {
                             UffdState& c = state();
                             if (c.fd >= 0) ::close(c.fd);
                             c.fd = -1;
                             c.tried = false;
                             c.why.clear();
                             ++c.generation;
                             c.mu.unlock();
                         });
        return st;
    }();
    return *s;
}

// False once `fd` no longer names the userfaultfd `id` identifies: other code closed it, and perhaps opened
// another file, another userfaultfd included, that got its number. The link text is asked too: on kernels
// where every anonymous file shares one inode, the inode alone cannot tell a userfaultfd from an eventfd.
// Without /proc to ask, the inode decides.
bool still_ours(int fd, const FileId& id) {
    if (!(file_id(fd) == id)) return false;
    const std::string link = "/proc/self/fd/" + std::to_string(fd);
    char target[64];
    ssize_t n = ::readlink(link.c_str(), target, sizeof target - 1);
    if (n < 0) return errno != ENOENT || ::access("/proc/self/fd", F_OK) != 0;
    target[n] = '\0';
    return std::strcmp(target, "anon_inode:[userfaultfd]") == 0;
}

// Answers every fault on an armed page with a zeroed page (what the kernel gives a new page anyway): only a
// touch before fill() faults there, and it must not hang. Returns only when other code closed the descriptor
// (os.closerange, a sweep of descriptors): the kernel then drops every registration with it once this
// thread lets go of the file, so no fault can wait any more, and the process goes on without fresh filling,
// instead of spinning on POLLNVAL or reading whatever file got the number next.
void serve(int fd, FileId id) {
    const size_t page = page_size();
    for (;;) {
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, -1) < 0) {
            if (errno != EINTR) ::usleep(1000);  // out of memory for the poll: again, shortly
            continue;
        }
        if ((p.revents & POLLNVAL) || !still_ours(fd, id)) {
            UffdState& s = state();
            std::lock_guard<std::mutex> lock(s.mu);
            if (s.fd == fd) {
                s.fd = -1;
                s.why = "userfaultfd: its descriptor was closed by other code";
            }
            return;
        }
        uffd_msg msg{};
        ssize_t n = ::read(fd, &msg, sizeof msg);
        if (n != static_cast<ssize_t>(sizeof msg) || msg.event != UFFD_EVENT_PAGEFAULT) continue;
        uffdio_zeropage z{};
        z.range.start = round_down(msg.arg.pagefault.address, page);
        z.range.len = page;
        int tries = 0;
        while (::ioctl(fd, UFFDIO_ZEROPAGE, &z) != 0 && errno == EAGAIN && ++tries < 100) {
        }
        // Whatever the outcome (made, filled meanwhile, unregistered, unmapped), wake the waiter: its fault
        // is retried, and goes the ordinary way where the page is no longer armed.
        uffdio_range r{z.range.start, page};
        ::ioctl(fd, UFFDIO_WAKE, &r);
    }
}

// Starts serve(fd) on a thread that blocks every signal: a process-directed signal (Ctrl-C, a profiler's
// timer) then goes to a thread that can act on it, and never interrupts the answer to a fault.
void start_server(int fd, FileId id) {
    sigset_t all, before;
    sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &before);
    try {
        std::thread(serve, fd, id).detach();
    } catch (...) {
        ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
        throw;
    }
    ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
}

bool lacks_resources(int err) { return err == EMFILE || err == ENFILE || err == ENOMEM || err == EAGAIN; }

// Opens and handshakes a userfaultfd and starts its server; the descriptor, or -1 with *why saying why not and
// *again true when the cause may pass (a resource that ran out).
int open_here(std::string* why, bool* again) {
    *again = false;
    const char* off = std::getenv(kSwitch);
    if (off != nullptr && std::string(off) == "0") {
        *why = std::string("turned off (") + kSwitch + "=0)";
        return -1;
    }
    int f = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
    if (f < 0 && errno == EPERM)  // unprivileged (vm.unprivileged_userfaultfd=0): user-mode faults only
        f = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
    if (f < 0) {
        *again = lacks_resources(errno);
        *why = "userfaultfd: " + errno_text(errno);
        return -1;
    }
    uffdio_api api{};
    api.api = UFFD_API;
    if (::ioctl(f, UFFDIO_API, &api) != 0) {
        *why = "userfaultfd UFFDIO_API: " + errno_text(errno);
        ::close(f);
        return -1;
    }
    try {
        start_server(f, file_id(f));
    } catch (const std::exception& e) {  // e.g. a pids limit: without the server an early touch would hang
        *again = true;
        *why = std::string("userfaultfd: cannot start the thread that serves it: ") + e.what();
        ::close(f);
        return -1;
    }
    *why = "ok";
    return f;
}

// This process's userfaultfd and generation (fd -1 when unavailable; why: `why`).
std::pair<int, unsigned long> uffd(std::string* why = nullptr) {
    UffdState& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.tried) {
        bool again = false;
        s.fd = open_here(&s.why, &again);
        s.tried = !again;
        if (s.fd >= 0) s.id = file_id(s.fd);
    } else if (s.fd >= 0 && !still_ours(s.fd, s.id)) {
        // Closed by other code while no fault woke the server: new blocks stay plain from now on.
        s.fd = -1;
        s.why = "userfaultfd: its descriptor was closed by other code";
    }
    if (why != nullptr) *why = s.why;
    return {s.fd, s.generation};
}

// The descriptor that armed `b`, if it is this process's and the block is still armed; else -1. Opens
// nothing: a block armed in this generation was armed with the descriptor this generation has (a forked
// child's copies belong to the parent's generation and are plain memory).
int armed_fd(const FreshBlock& b) {
    if (!b.armed.load(std::memory_order_acquire)) return -1;
    UffdState& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    return s.generation == b.generation ? s.fd : -1;
}

// UFFDIO_COPY of the armed pages [dst, dst+n) from src; the pages it cannot fill that way are copied plainly.
void fill_pages(int fd, uintptr_t dst, const char* src, size_t n) {
    const size_t page = page_size();
    size_t done = 0;
    while (done < n) {
        uffdio_copy c{};
        c.dst = dst + done;
        c.src = reinterpret_cast<uintptr_t>(src + done);
        c.len = n - done;
        int rc = ::ioctl(fd, UFFDIO_COPY, &c);
        if (c.copy > 0) done += static_cast<size_t>(c.copy);
        if (rc == 0 || errno == EAGAIN) continue;  // EAGAIN: part copied (counted above), the rest again
        if (errno == EEXIST) {  // a page present already (touched early, or a partial page): copy over it
            bulk_copy(reinterpret_cast<char*>(dst + done), src + done, page);
            done += page;
            continue;
        }
        bulk_copy(reinterpret_cast<char*>(dst + done), src + done, n - done);  // refused: the plain way
        return;
    }
}

// Registers the whole of `b`'s mapping and makes its partial first and last pages (zeroed, filled by whoever
// writes the tensor's edges): the whole mapping, so that neighbouring blocks' mappings merge (one per block
// would reach vm.max_map_count on a checkpoint of tens of thousands of tensors); those pages made now, so
// that writing the edges later faults nothing. False (the block left plain) when anything is refused and the
// registration could be undone.
bool arm(int fd, FreshBlock& b, size_t residue, size_t nbytes) {
    const size_t page = page_size();
    uffdio_register reg{};
    reg.range.start = reinterpret_cast<uintptr_t>(b.base);
    reg.range.len = b.len;
    reg.mode = UFFDIO_REGISTER_MODE_MISSING;
    if (::ioctl(fd, UFFDIO_REGISTER, &reg) != 0) return false;
    bool ok = (reg.ioctls & (uint64_t{1} << _UFFDIO_COPY)) != 0;
    alignas(64) static const char zeros[1 << 16] = {};
    auto make = [&](uintptr_t at) {
        uffdio_copy c{};
        c.dst = at;
        c.src = reinterpret_cast<uintptr_t>(zeros);
        c.len = page;
        return page <= sizeof zeros && (::ioctl(fd, UFFDIO_COPY, &c) == 0 || errno == EEXIST);
    };
    const uintptr_t first = reg.range.start, last = first + b.len - page;
    if (ok && (residue != 0 || nbytes < page)) ok = make(first);
    if (ok && last != first && (residue + nbytes) % page != 0) ok = make(last);
    if (!ok) {
        uffdio_range r{reg.range.start, reg.range.len};
        // A block the kernel keeps registered must count as armed, edges made or not: reads into it are then
        // staged, and a touch of a page not made is answered like any other. Left plain, a read(2) into it
        // would fail with EFAULT under a user-mode-only userfaultfd.
        if (::ioctl(fd, UFFDIO_UNREGISTER, &r) != 0) return true;
    }
    return ok;
}

#endif  // DNV_HAVE_UFFD

}  // namespace

std::string fresh_memory_status() {
#if DNV_HAVE_UFFD
    std::string why;
    uffd(&why);
    return why;
#else
    return "userfaultfd is not available on this platform";
#endif
}

namespace {
struct Unmap {
    size_t len;
    void operator()(char* p) const { ::munmap(p, len); }
};
}  // namespace

FreshBlock* fresh_allocate(size_t nbytes, size_t residue) {
    const size_t page = page_size();
    if (residue >= page) throw ArgError("residue must be in [0, " + std::to_string(page) + ")");
    if (nbytes > (size_t(1) << 60)) throw std::bad_alloc();
    size_t len = round_up(nbytes + residue, page);
    if (len == 0) len = page;
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    std::unique_ptr<char, Unmap> mapping(static_cast<char*>(p), Unmap{len});
    auto b = std::make_unique<FreshBlock>();
    b->base = mapping.get();
    b->len = len;
#if DNV_HAVE_UFFD
    auto [fd, generation] = uffd();
    if (fd >= 0 && nbytes > 0 && arm(fd, *b, residue, nbytes)) {
        b->generation = generation;
        b->armed.store(true, std::memory_order_release);
    }
#endif
    mapping.release();
    return b.release();
}

void fresh_free(void* block) {
    auto* b = static_cast<FreshBlock*>(block);
    ::munmap(b->base, b->len);  // unregisters what is still armed
    delete b;
}

void fresh_fill(FreshBlock& b, char* dst, const char* src, size_t n) {
#if DNV_HAVE_UFFD
    int fd = armed_fd(b);
    if (fd >= 0) {
        const size_t page = page_size();
        const uintptr_t d = reinterpret_cast<uintptr_t>(dst), begin = reinterpret_cast<uintptr_t>(b.base);
        uintptr_t a = std::max(round_up(d, page), begin);
        uintptr_t z = std::min(round_down(d + n, page), begin + b.len);
        if (a < z) {
            bulk_copy(dst, src, a - d);
            fill_pages(fd, a, src + (a - d), z - a);
            bulk_copy(reinterpret_cast<char*>(z), src + (z - d), d + n - z);
            return;
        }
    }
#endif
    bulk_copy(dst, src, n);
}

void fresh_settle(FreshBlock& b) {
#if DNV_HAVE_UFFD
    int fd = armed_fd(b);
    if (fd >= 0) {
        // Unregistered first, plain after: a read submitted meanwhile is still staged, and its fill, refused
        // once the pages are unregistered (ENOENT), copies plainly. A refusal leaves the block armed.
        uffdio_range r{reinterpret_cast<uintptr_t>(b.base), b.len};
        if (::ioctl(fd, UFFDIO_UNREGISTER, &r) != 0) return;
    }
#endif
    b.armed.store(false, std::memory_order_release);  // a forked child's copy was never registered
}

void FreshCopier::to_host(void* dst, size_t offset, size_t len) const { std::memcpy(dst, mem_ + offset, len); }

void FreshCopier::from_host(size_t offset, const void* src, size_t len) const {
    fresh_fill(*block_, mem_ + offset, static_cast<const char*>(src), len);
}

}  // namespace dnv

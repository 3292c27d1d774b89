#include "fresh_memory.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>
#include <thread>

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

// The process's userfaultfd and the thread answering stray faults. One per process, never destroyed (no work
// runs in a static destructor); a forked child replaces its inherited copy on first use.
class Uffd {
public:
    // This process's instance, or nullptr (why: `reason`) when userfaultfd is unavailable here.
    static Uffd* get(std::string* reason = nullptr) {
        std::lock_guard<std::mutex> lock(mu());
        static bool hooked = [] {
            ::pthread_atfork([] { mu().lock(); }, [] { mu().unlock(); }, [] { mu().unlock(); });
            return true;
        }();
        (void)hooked;
        long pid = static_cast<long>(::getpid());
        if (pid_ != pid) {  // first use, or a forked child holding its parent's descriptor
            if (fd_ >= 0) ::close(fd_);  // the child's copy only: the parent's stays open
            fd_ = -1;
            pid_ = pid;
            why_ = open_here(&fd_);
            if (fd_ >= 0) std::thread(serve, fd_).detach();
        }
        if (reason != nullptr) *reason = why_;
        return fd_ >= 0 ? &instance() : nullptr;
    }

    int fd() const { return fd_; }
    long pid() const { return pid_; }

private:
    static Uffd& instance() {
        static Uffd u;
        return u;
    }
    static std::mutex& mu() {
        static std::mutex m;
        return m;
    }

    // Opens and handshakes a userfaultfd into *fd; "ok", or why it could not.
    static std::string open_here(int* fd) {
        int f = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
        if (f < 0 && errno == EPERM)  // unprivileged (vm.unprivileged_userfaultfd=0): user-mode faults only
            f = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
        if (f < 0) return "userfaultfd: " + errno_text(errno);
        uffdio_api api{};
        api.api = UFFD_API;
        if (::ioctl(f, UFFDIO_API, &api) != 0) {
            std::string why = "userfaultfd UFFDIO_API: " + errno_text(errno);
            ::close(f);
            return why;
        }
        *fd = f;
        return "ok";
    }

    // Answers every fault on an armed page with a zeroed page (what the kernel gives a fresh page anyway): only
    // a touch before fill() faults there, and it must not hang.
    static void serve(int fd) {
        const size_t page = page_size();
        for (;;) {
            pollfd p{fd, POLLIN, 0};
            if (::poll(&p, 1, -1) < 0) {
                if (errno == EINTR) continue;
                return;
            }
            if (p.revents & (POLLERR | POLLNVAL)) return;  // closed in a forked child's replacement
            uffd_msg msg{};
            ssize_t n = ::read(fd, &msg, sizeof msg);
            if (n != static_cast<ssize_t>(sizeof msg)) continue;  // EAGAIN: another reader took it
            if (msg.event != UFFD_EVENT_PAGEFAULT) continue;
            uffdio_zeropage z{};
            z.range.start = round_down(msg.arg.pagefault.address, page);
            z.range.len = page;
            for (int tries = 0; tries < 100; ++tries) {
                if (::ioctl(fd, UFFDIO_ZEROPAGE, &z) == 0) break;
                if (errno == EAGAIN) continue;  // the address space was changing: again
                // EEXIST: filled meanwhile; anything else (unregistered, unmapped): wake the waiter, whose
                // fault then goes the ordinary way.
                uffdio_range r{z.range.start, page};
                ::ioctl(fd, UFFDIO_WAKE, &r);
                break;
            }
        }
    }

    static inline int fd_ = -1;
    static inline long pid_ = 0;
    static inline std::string why_;
};

// The descriptor that armed `b`, if it belongs to this process and the block is still armed; else -1.
int armed_fd(const FreshBlock& b) {
    if (!b.armed.load(std::memory_order_acquire)) return -1;
    Uffd* u = Uffd::get();
    return u != nullptr && u->pid() == b.owner ? u->fd() : -1;
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
        if (errno == EEXIST) {  // a page present already (touched early): copy over it plainly
            bulk_copy(reinterpret_cast<char*>(dst + done), src + done, page);
            done += page;
            continue;
        }
        bulk_copy(reinterpret_cast<char*>(dst + done), src + done, n - done);  // refused: the plain way
        return;
    }
}

#endif  // DNV_HAVE_UFFD

}  // namespace

std::string fresh_memory_status() {
#if DNV_HAVE_UFFD
    std::string why;
    Uffd::get(&why);
    return why;
#else
    return "userfaultfd is not available on this platform";
#endif
}

FreshBlock* fresh_allocate(size_t nbytes, size_t residue) {
    const size_t page = page_size();
    if (residue >= page) throw ArgError("residue must be in [0, " + std::to_string(page) + ")");
    size_t len = round_up(nbytes + residue, page);
    if (len == 0) len = page;
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    auto* b = new (std::nothrow) FreshBlock;
    if (b == nullptr) {
        ::munmap(p, len);
        throw std::bad_alloc();
    }
    b->base = static_cast<char*>(p);
    b->len = len;
#if DNV_HAVE_UFFD
    uintptr_t data = reinterpret_cast<uintptr_t>(p) + residue;
    uintptr_t begin = round_up(data, page), end = round_down(data + nbytes, page);
    Uffd* u = Uffd::get();
    if (u != nullptr && begin < end) {
        uffdio_register reg{};
        reg.range.start = begin;
        reg.range.len = end - begin;
        reg.mode = UFFDIO_REGISTER_MODE_MISSING;
        // A refusal (e.g. out of mappings) leaves a plain block: the same memory, made the usual way.
        if (::ioctl(u->fd(), UFFDIO_REGISTER, &reg) == 0 && (reg.ioctls & (uint64_t{1} << _UFFDIO_COPY))) {
            b->armed_begin = begin;
            b->armed_end = end;
            b->owner = u->pid();
            b->armed.store(true, std::memory_order_release);
        }
    }
#endif
    return b;
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
        uintptr_t d = reinterpret_cast<uintptr_t>(dst);
        uintptr_t a = std::max(round_up(d, page), b.armed_begin);
        uintptr_t z = std::min(round_down(d + n, page), b.armed_end);
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
    if (!b.armed.exchange(false, std::memory_order_acq_rel)) return;
#if DNV_HAVE_UFFD
    Uffd* u = Uffd::get();
    if (u == nullptr || u->pid() != b.owner) return;  // a forked child: its mappings were never registered
    uffdio_range r{b.armed_begin, b.armed_end - b.armed_begin};
    ::ioctl(u->fd(), UFFDIO_UNREGISTER, &r);  // wakes any fault still waiting there, which then goes the usual way
#endif
}

void FreshCopier::to_host(void* dst, size_t offset, size_t len) const { std::memcpy(dst, mem_ + offset, len); }

void FreshCopier::from_host(size_t offset, const void* src, size_t len) const {
    fresh_fill(*block_, mem_ + offset, static_cast<const char*>(src), len);
}

}  // namespace dnv

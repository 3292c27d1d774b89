// Threads of the library's own take no asynchronous signals. A process-directed signal (Ctrl-C, setitimer's
// SIGALRM, a profiler's SIGPROF) goes to any thread that does not block it; in one of ours it can only do
// harm: Python runs handlers on its main thread anyway, and a signal pending on a thread that submits to
// io_uring makes the kernel's creation of an io-wq helper fail (copy_process gives -ERESTARTNOINTR); after
// three such failures in a row the kernel cancels the request queued for the helper, which then completes
// with ECANCELED. Signals the kernel raises on the faulting thread itself stay open, so that a fault still
// reaches its handler (faulthandler's included) or kills the process as it would anywhere.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <thread>
#include <utility>

namespace dnv {

// Every signal but the synchronous ones (glibc keeps its own internal signals out of the set).
inline sigset_t asynchronous_signals() {
    sigset_t set;
    sigfillset(&set);
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT}) sigdelset(&set, sig);
    return set;
}

// Blocks the asynchronous signals in the calling thread while it lives; the thread's mask is restored after.
class SignalsBlocked {
public:
    SignalsBlocked() {
        const sigset_t set = asynchronous_signals();
        ::pthread_sigmask(SIG_BLOCK, &set, &before_);
    }
    ~SignalsBlocked() { ::pthread_sigmask(SIG_SETMASK, &before_, nullptr); }
    SignalsBlocked(const SignalsBlocked&) = delete;
    SignalsBlocked& operator=(const SignalsBlocked&) = delete;

private:
    sigset_t before_{};
};

// A thread running `fn` that blocks the asynchronous signals from its first instruction (it inherits the
// mask of its creator, which has them blocked only while it is made), named `name` (at most 15 characters)
// for top -H, gdb and /proc/<pid>/task/<tid>/comm.
template <class Fn>
std::thread quiet_thread(const char* name, Fn&& fn) {
    SignalsBlocked blocked;
    return std::thread([name, f = std::forward<Fn>(fn)]() mutable {
        ::pthread_setname_np(::pthread_self(), name);
        f();
    });
}

}  // namespace dnv

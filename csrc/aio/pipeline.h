// The request pipeline every handle shares (aio_handle's engine, gds_handle's cuFile side): request ids, the
// pending set, wait()'s thread contract with cancellation on interruption, drain, the first failure, and the
// fork check. An engine only moves bytes and calls complete(); the rest of a request's life is here.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "file.h"

namespace dnv {

// Who hands a request over to the program, and so raises its error: the call that submitted it (a sync call),
// DeepSpeed's wait() (an async request), or wait_request() for its id alone (a request completed on its own:
// submit_pread / submit_pwrite). Each request is handed over once, by the one kind of call its kind names.
enum class Completion { kCall, kWait, kOwn };

// What every transfer carries, whichever engine moves it. Shared by the pipeline (until a call reports it)
// and every wait() that covers it; the last holder destroys it.
class PendingRequest {
public:
    virtual ~PendingRequest() = default;

    uint64_t id = 0;
    bool write = false;
    Completion completion = Completion::kCall;
    bool validate = false;
    size_t nbytes = 0;
    uint64_t offset = 0;  // file offset
    TargetFile file;
    std::shared_ptr<void> keepalive;  // the binding's tensor references; released by the claimer

    // Opens `path` (or duplicates the caller's `fd`) for this transfer; a read must lie within the file.
    // `own_dup`: a duplicate of `fd` for this request alone (see TargetFile::from_fd).
    // Throws IoError/ArgError before any I/O.
    void open_target(const std::string& path, int fd, bool own_dup = false);

    // First failure wins; later ones are dropped (they are usually consequences of the first).
    void fail(int err, const std::string& what);
    bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }
    int error() const noexcept { return err_; }
    const std::string& error_text() const noexcept { return err_what_; }

    // Reads the file range back and compares it with the memory: "" when equal, else what differs. Called
    // after completion, off the GIL.
    virtual std::string verify() = 0;

    // Submitted to run on the workers while its call returns (wait() or wait_request() completes it).
    bool is_async() const noexcept { return completion != Completion::kCall; }

    bool done = false;      // guarded by the pipeline's mutex
    bool reported = false;  // a call has handed it over (and left the pending set); same mutex
    bool announced = false; // wait_completed() returned its id (Completion::kOwn only); same mutex

private:
    std::atomic<bool> failed_{false};
    std::mutex err_mu_;
    int err_ = 0;
    std::string err_what_;
};

using Handed = std::vector<std::shared_ptr<PendingRequest>>;

class Pipeline {
public:
    // `owner` names the handle in errors ("aio handle").
    explicit Pipeline(std::string owner);
    Pipeline(const Pipeline&) = delete;
    Pipeline& operator=(const Pipeline&) = delete;

    // Thrown by wait() when `interrupted` said stop: the requests it cancelled have finished and were handed
    // over in `out`; the caller raises whatever the interruption was (KeyboardInterrupt).
    struct Interrupted {};
    static constexpr std::chrono::milliseconds kPollInterval{50};

    // Gives `r` its id (increasing: pending_ stays in id order) and makes it pending; `finished` for a request with nothing to move. Once pending, it
    // can complete and be freed by another thread's wait(): the caller reads nothing of it afterwards.
    uint64_t add(std::shared_ptr<PendingRequest> r, bool finished);
    // The engine's last word on `r` (called once, on any thread).
    void complete(PendingRequest* r);

    // The thread contract (see README, "Guarantees"). A call covers `own` (0 for none) and every async request
    // (Completion::kWait) pending when it starts, whoever submitted it, never a Completion::kOwn one; it returns once all of them have completed and hands them
    // over in `out`. It returns how many of them it was the first to hand over, so that every request is
    // counted by exactly one call however the calls overlap:
    //  - wait() (own == 0) hands over everything it covered (another wait() covering the same requests at the
    //    same time gets them too: each raises their error);
    //  - a sync call (own != 0) hands over its own request and the covered async ones that completed cleanly;
    //    a failed async request, or one still to be validated, stays pending for a wait() to report.
    // `interrupted`, if set, is polled every kPollInterval while waiting; when it returns true the call
    // cancels (wait()) what it covers or (sync call) its own request, waits for the work already in flight,
    // hands the cancelled requests over and throws Interrupted; `out` then also holds references to the
    // other covered requests (still pending), for the caller to release with the GIL held and not report.
    size_t wait(uint64_t own, Handed& out, const std::function<bool()>& interrupted = {});

    // Completion per request, for requests submitted with Completion::kOwn (no other call covers them).
    // wait_request() waits for request `id` alone and hands it over in `out`, exactly once: a later call for
    // the id, or a concurrent one that did not get it, throws ArgError naming it, as does an id that is not
    // such a request pending here. `interrupted` is polled as by wait(), but the request is not cancelled:
    // it stays pending (its id still valid) for a later wait_request() or the handle's close, and the call
    // throws Interrupted. `out` holds a reference to the request however the call ends, for the caller to
    // release with the GIL held (another thread's call may have left it the last one).
    void wait_request(uint64_t id, Handed& out, const std::function<bool()>& interrupted = {});
    // Whether request `id` has completed (without handing it over). ArgError as for wait_request().
    bool request_done(uint64_t id);
    // The ids of Completion::kOwn requests that have completed, are not handed over, and that no earlier call
    // returned (in id order), once there is at least one, or none when `timeout` passes first (negative: no limit; the call
    // also waits while nothing is pending, for requests submitted meanwhile). Each id is returned by one call
    // only; nothing is handed over (wait_request() then returns at once). `interrupted` as for wait_request().
    std::vector<uint64_t> wait_completed(std::chrono::milliseconds timeout,
                                         const std::function<bool()>& interrupted = {});

    // Waits for everything still pending and hands it over (for destruction). In a process forked from the
    // pipeline's creator it waits for nothing: the workers are the parent's.
    void drain(Handed& out);

    // True in a child forked after the pipeline was made: it has none of the handle's threads.
    bool inherited() const noexcept;
    // UnsupportedError when inherited(): the handle refuses work there.
    void refuse_if_inherited() const;
    // In an inherited child: keeps every pending request alive for good (the parent's workers, which this
    // process does not have, may point into them) and forgets them. Their tensor holds, which no thread of
    // this process uses, go to `holds` when given, for the caller to drop with the GIL held: the child's
    // tensors then get their own storages back (storage_loan.h) instead of keeping a loan for good.
    void abandon(std::vector<std::shared_ptr<void>>* holds = nullptr);

private:
    // Where request `id` is, or would be, in pending_ (binary search). Called with mu_ held.
    Handed::iterator find_pending(uint64_t id);
    // The pending Completion::kOwn request `id`, else ArgError. Called with mu_ held.
    const std::shared_ptr<PendingRequest>& own_request(uint64_t id);

    std::mutex mu_;
    std::condition_variable cv_;
    Handed pending_;  // in id order
    uint64_t next_id_ = 0;
    std::string owner_;
    unsigned fork_generation_ = 0;  // forks this process had seen when the pipeline was made
};

// The first failed request among `reqs` (submission order), or null.
const PendingRequest* first_failure(const Handed& reqs);

// True the first time `cause` is seen in this process: warnings are given once per cause.
bool first_notice(const std::string& cause);

}  // namespace dnv

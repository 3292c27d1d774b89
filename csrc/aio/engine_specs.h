// Entry points of the individual engine files, gathered by engines.cpp into one table.
// Only engines.cpp and the engine files include this; the handle sees engine.h alone.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine.h"

namespace dnv {

// One synchronous pread/pwrite with EINTR retry: bytes moved or -errno. Shared by posix and fault.
int64_t transfer_once(const IoOp& op);

// Base of the engines that finish each op inside submit(): completions wait in done_ until reaped.
class InlineEngine : public Engine {
public:
    size_t reap(IoDone* out, size_t min_done, size_t max) override;

protected:
    std::vector<IoDone> done_;
};

std::unique_ptr<Engine> make_posix_engine(unsigned qd, const std::shared_ptr<EngineShared>& shared);
std::string probe_posix();

std::unique_ptr<Engine> make_fault_engine(unsigned qd, const std::shared_ptr<EngineShared>& shared);
std::shared_ptr<EngineShared> make_fault_shared();
std::string probe_fault();

#if DEEPNVME_WITH_LIBAIO
std::unique_ptr<Engine> make_libaio_engine(unsigned qd, const std::shared_ptr<EngineShared>& shared);
std::string probe_libaio();
#endif

#if DEEPNVME_WITH_URING
std::unique_ptr<Engine> make_uring_engine(unsigned qd, const std::shared_ptr<EngineShared>& shared);
std::string probe_uring();
#endif

// A real one-block read through a fresh engine; "" when it worked, else why not. Used by the probes.
std::string round_trip(std::unique_ptr<Engine> engine);

}  // namespace dnv

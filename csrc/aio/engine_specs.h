// Entry points of the individual engine files, declared from engine_list.h and gathered by engines.cpp.
// Only engines.cpp and the engine files include this; the handle sees engine.h alone.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine.h"
#include "engine_list.h"

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

// Every engine's entry points, declared from the one list. An engine whose library was missing at build time
// still defines both: make_* throws UnsupportedError and probe_* says why, so the table never changes shape.
#define DNV_DECLARE_ENGINE(id, name, automatic, shared)                                                     \
    std::unique_ptr<Engine> make_##id##_engine(unsigned qd, const std::shared_ptr<EngineShared>& shared_state); \
    std::string probe_##id();
DNV_ENGINE_LIST(DNV_DECLARE_ENGINE)
#undef DNV_DECLARE_ENGINE

// Per-handle state of the fault engine (its rule counters).
std::shared_ptr<EngineShared> make_fault_shared();

// Why an engine that needs a library is a stub in this build.
std::string not_built_reason(const char* library, const char* package);

// A real one-block read through a fresh engine; "" when it worked, else why not. Used by the probes.
std::string round_trip(std::unique_ptr<Engine> engine);

}  // namespace dnv

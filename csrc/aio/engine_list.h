// The engines this library knows, in the order engine="auto" prefers them: one X-macro row per engine.
// The rows mirror op_builder/engines.py (the catalogue); tests/aio/test_engine_catalogue.py checks they agree.
//
// DNV_ENGINE(cpp_id, name, automatic, shared_factory)
//   cpp_id          engine_<cpp_id>.cpp defines make_<cpp_id>_engine and probe_<cpp_id> (a stub that
//                   reports "not built in" when its library was missing at build time)
//   automatic       whether "auto" may pick it
//   shared_factory  per-handle state shared by the handle's engines, or nullptr
#pragma once

#define DNV_ENGINE_LIST(DNV_ENGINE)                               \
    DNV_ENGINE(uring, "io_uring", true, nullptr)                  \
    DNV_ENGINE(libaio, "libaio", true, nullptr)                   \
    DNV_ENGINE(posix, "posix", true, nullptr)                     \
    DNV_ENGINE(fault, "fault", false, make_fault_shared)

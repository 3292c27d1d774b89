// Error model of the engine: one exception type per Python exception the binding raises.
// C++ code below the binding throws these; it never asserts, exits or prints.
#pragma once

#include <cerrno>
#include <stdexcept>
#include <string>

namespace dnv {

// An operating-system failure: becomes OSError(errno, message, filename) in Python.
class IoError : public std::runtime_error {
public:
    IoError(int err, std::string what, std::string path)
        : std::runtime_error(std::move(what)), err_(err), path_(std::move(path)) {}
    int err() const noexcept { return err_; }
    const std::string& path() const noexcept { return path_; }

private:
    int err_;
    std::string path_;
};

// A bad argument from the caller: becomes ValueError.
class ArgError : public std::invalid_argument {
public:
    using std::invalid_argument::invalid_argument;
};

// The library or machine cannot do what was asked (engine unavailable, ...): becomes RuntimeError.
class UnsupportedError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// Text of an errno value, thread-safe (strerror is not).
std::string errno_text(int err);

[[noreturn]] inline void throw_io(int err, const std::string& what, const std::string& path) {
    throw IoError(err, what + ": " + errno_text(err), path);
}

}  // namespace dnv

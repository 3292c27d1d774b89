#!/usr/bin/env bash
# Run a command with deepnvme's ops built and loaded under sanitizers:
#
#   tests/sanitize/run.sh address,undefined python3 -m pytest -q tests/aio/test_aio_errors.py
#   tests/sanitize/run.sh thread python3 -m pytest -q tests/aio/test_aio_threads.py
#
# DEEPNVME_SANITIZE makes the op builder compile with -fsanitize=... into a module and build folder of their
# own (deepnvme_async_io_asan_ubsan, deepnvme_async_io_tsan), beside the normal build. Python is not built
# with a sanitizer, so the sanitizer's runtime has to be the first library in the process: LD_PRELOAD it
# (the one of the compiler that builds the ops, so both agree on its version). Subprocesses inherit all of it.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 address,undefined|thread COMMAND [ARGS...]" >&2
    exit 2
fi
sanitizers=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
cxx=${CXX:-c++}

runtime() {  # the compiler's own copy of a sanitizer runtime, as an absolute path
    local path
    path=$($cxx -print-file-name="$1")
    if [ "$path" = "$1" ] || [ ! -e "$path" ]; then
        echo "$0: $cxx has no $1 (install the compiler's sanitizer runtime, e.g. libasan8/libtsan2)" >&2
        exit 2
    fi
    realpath "$path"
}

case ",$sanitizers," in
    *,thread,*)
        preload=$(runtime libtsan.so)
        # CPython and torch are not instrumented: TSan sees their locks (the GIL included) through its
        # interceptors, and their memory accesses only where they call an intercepted function (memcpy...).
        # So it can miss a race against their code but not invent one in ours. Not
        # ignore_noninstrumented_modules=1: with gcc's runtime it also hid a real race between two of
        # deepnvme's own workers (tests/sanitize/tsan_canary.py). tsan.supp says what is suppressed, and why.
        export TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1 suppressions=$here/tsan.supp ${TSAN_OPTIONS:-}"
        ;;
    *,address,*)
        preload=$(runtime libasan.so)
        # detect_leaks=0: CPython and torch keep allocations alive until exit on purpose, and LeakSanitizer
        # would report them all. Leaks of the ops are tested directly (fd and VmLck counts, 1000 handles).
        export ASAN_OPTIONS="detect_leaks=0 abort_on_error=0 halt_on_error=1 exitcode=66 ${ASAN_OPTIONS:-}"
        ;;
    *)
        preload=
        ;;
esac
case ",$sanitizers," in
    *,undefined,*)
        export UBSAN_OPTIONS="print_stacktrace=1 halt_on_error=1 exitcode=66 ${UBSAN_OPTIONS:-}"
        [ -n "$preload" ] || preload=$(runtime libubsan.so)
        ;;
esac

# libstdc++ right after the runtime: Python is C, so without it libstdc++ arrives later with the extension,
# after ASan looked up the real __cxa_throw, and the first C++ exception stops the process on a failed CHECK
# ("real___cxa_throw != 0").
[ -z "$preload" ] || preload="$preload $(runtime libstdc++.so)"

export DEEPNVME_SANITIZE=$sanitizers
export DEEPNVME_SANITIZE_PRELOAD=$preload  # the op builder leaves these out of its compilers' environment
export LD_PRELOAD="$preload${LD_PRELOAD:+ $LD_PRELOAD}"
exec "$@"

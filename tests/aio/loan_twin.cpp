// A second extension carrying its own copy of csrc/aio/storage_loan.cpp, as the gds op does beside the aio
// op: tests/aio/test_storage_loan.py takes loans through both and checks they share one table. A storage
// is passed by its StorageImpl address (Python's `untyped_storage()._cdata`), so that only c10's headers are
// needed and the build stays quick.
#include <Python.h>
#include <c10/core/StorageImpl.h>

#include <map>
#include <memory>

#include "storage_loan.h"

#define TWIN_CAT2(a, b) a##b
#define TWIN_CAT(a, b) TWIN_CAT2(a, b)
#define TWIN_STR2(x) #x
#define TWIN_STR(x) TWIN_STR2(x)

namespace {

std::map<long, std::unique_ptr<dnv::StorageLoan>> loans;
long next_id = 0;

PyObject* lend(PyObject*, PyObject* cdata) {
    auto* impl = static_cast<c10::StorageImpl*>(PyLong_AsVoidPtr(cdata));
    if (impl == nullptr) return PyErr_Occurred() ? nullptr : PyErr_Format(PyExc_ValueError, "null storage");
    c10::Storage storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl));
    loans[++next_id] = std::make_unique<dnv::StorageLoan>(std::move(storage));
    return PyLong_FromLong(next_id);
}

PyObject* end(PyObject*, PyObject* id) {
    loans.erase(PyLong_AsLong(id));
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {{"lend", lend, METH_O, "a loan of the storage at this address; its id"},
                         {"end", end, METH_O, "ends the loan with this id"},
                         {nullptr, nullptr, 0, nullptr}};
PyModuleDef module = {PyModuleDef_HEAD_INIT, TWIN_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC TWIN_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }

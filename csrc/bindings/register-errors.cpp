// moetier's exception classes live here, so that the C API's error kinds map onto them without
// looking at message text: MoetierError, and under it ConfigError (also a ValueError), StoreError
// and ModelError. python/moetier/errors.py re-exports them.

#include "bindings.h"

#include <Python.h>

namespace py = pybind11;

namespace {

// new exception class moetier.NAME with the given bases and docstring, owned by the module
py::object make_exception(py::module_ & m, const char * name, py::tuple bases, const char * doc) {
    const std::string qual = std::string("moetier.") + name;
    PyObject *        cls  = PyErr_NewExceptionWithDoc(qual.c_str(), doc, bases.ptr(), nullptr);
    if (!cls) {
        throw py::error_already_set();
    }
    py::object o = py::reinterpret_steal<py::object>(cls);
    m.attr(name) = o;
    return o;
}

}  // namespace

void register_errors(py::module_ & m) {
    py::object base =
        make_exception(m, "MoetierError", py::make_tuple(py::reinterpret_borrow<py::object>(PyExc_Exception)),
                       "Base of every error moetier raises on purpose.");
    make_exception(m, "ConfigError", py::make_tuple(base, py::reinterpret_borrow<py::object>(PyExc_ValueError)),
                   "A configuration value is invalid (size, range, unknown name).");
    make_exception(m, "StoreError", py::make_tuple(base),
                   "An expert store is missing, incomplete, corrupt or belongs to another model.");
    make_exception(m, "ModelError", py::make_tuple(base), "A model could not be loaded or run.");

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) {
                std::rethrow_exception(p);
            }
        } catch (const moetier_py_error & e) {
            const char * name = "ModelError";
            switch (e.kind) {
                case MOETIER_ERROR_CONFIG:
                    name = "ConfigError";
                    break;
                case MOETIER_ERROR_STORE:
                    name = "StoreError";
                    break;
                default:
                    break;
            }
            py::object cls = py::module_::import("moetier._core").attr(name);
            // messages quote file names and file contents, which need not be UTF-8: PyErr_SetString
            // would raise UnicodeDecodeError instead of the error itself; stray bytes show as \xNN
            PyObject * msg = PyUnicode_DecodeUTF8(e.msg.data(), (Py_ssize_t) e.msg.size(), "backslashreplace");
            if (!msg) {
                return;  // the decode's own error (out of memory) is set
            }
            PyErr_SetObject(cls.ptr(), msg);
            Py_DECREF(msg);
        }
    });
}

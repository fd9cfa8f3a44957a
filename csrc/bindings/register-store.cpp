// moetier._core: packing an expert store.

#include "bindings.h"
#include "moetier-crc32c.h"
#include "moetier-impl.h"
#include "moetier.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

struct pack_progress {
    py::function fn;
    bool         cancelled = false;
};

bool pack_progress_cb(uint64_t done, uint64_t total, void * ud) {
    pack_progress *        p = (pack_progress *) ud;
    py::gil_scoped_acquire acquire;
    try {
        py::object r = p->fn(done, total);
        return r.is_none() || r.cast<bool>();
    } catch (...) {
        p->cancelled = true;
        return false;
    }
}

}  // namespace

void register_store(py::module_ & m) {
    m.def(
        "checksum",
        [](const py::buffer & data, const std::string & kind) -> uint64_t {
            const py::buffer_info info = data.request();
            if (!PyBuffer_IsContiguous(info.view(), 'C')) {
                throw std::invalid_argument("checksum: the buffer is not contiguous");
            }
            const size_t           n = (size_t) info.size * (size_t) info.itemsize;
            py::gil_scoped_release release;
            if (kind == "crc32c") {
                return moetier_crc32c(0, info.ptr, n);
            }
            if (kind == "crc32c-portable") {
                return moetier_crc32c_with("portable", 0, info.ptr, n);
            }
            if (kind == "fnv64") {
                return moetier_checksum(info.ptr, n);
            }
            throw std::invalid_argument("checksum: kind is one of crc32c, crc32c-portable, fnv64, not " + kind);
        },
        py::arg("data"), py::arg("kind") = "crc32c",
        "the checksum of a buffer's bytes: crc32c (what a store holds, with the CPU's CRC instructions where it "
        "has them), crc32c-portable (the table loop, the same values), fnv64 (the hash of stores of version 1)");
    m.def(
        "crc32c_impl", [] { return std::string(moetier_crc32c_impl()); },
        "which CRC32C runs here: sse4.2, armv8-crc or portable");
    m.def(
        "pack",
        [](const std::string & model_path, const std::string & out_dir, const std::string & low_type,
           py::object progress) {
            moetier_pack_params p = moetier_pack_default_params();
            p.low_type            = low_type.c_str();
            pack_progress pp;
            if (!progress.is_none()) {
                pp.fn                         = progress;
                p.progress_callback           = pack_progress_cb;
                p.progress_callback_user_data = &pp;
            }
            int32_t rc;
            {
                py::gil_scoped_release release;
                rc = moetier_pack(model_path.c_str(), out_dir.c_str(), p);
            }
            if (rc == -2) {
                throw moetier_py_error{ MOETIER_ERROR_STORE, out_dir + ": pack cancelled" };
            }
            if (rc != 0) {
                throw moetier_py_error{ moetier_last_error_kind(), moetier_last_error() };
            }
        },
        py::arg("model_path"), py::arg("out_dir"), py::arg("low_type") = "q4_0", py::arg("progress") = py::none(),
        "write the expert store of a GGUF MoE model (see moetier.h moetier_pack)");

    m.def(
        "pack_defaults",
        []() {
            const moetier_pack_params p = moetier_pack_default_params();
            py::dict                  d;
            d["low_type"] = p.low_type;
            return d;
        },
        "moetier_pack_default_params() (low_type)");

    m.def(
        "predictor_path",
        [](const std::string & model_path, const std::string & store_dir) {
            char buf[4096];
            if (moetier_predictor_path(model_path.c_str(), store_dir.c_str(), buf, sizeof(buf)) < 0) {
                throw moetier_py_error{ moetier_last_error_kind(), moetier_last_error() };
            }
            return std::string(buf);
        },
        py::arg("model_path"), py::arg("store_dir") = "",
        "where the prefetcher looks for the fitted predictor of a model (and store)");
    m.def(
        "predictor_model_key",
        [](const std::string & model_path) {
            char buf[256];
            if (moetier_predictor_model_key(model_path.c_str(), buf, sizeof(buf)) < 0) {
                throw moetier_py_error{ moetier_last_error_kind(), moetier_last_error() };
            }
            return std::string(buf);
        },
        py::arg("model_path"), "the model identity a fitted predictor must name");
}

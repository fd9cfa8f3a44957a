// moetier._core: store packing, size parsing and the defaults Python config reads.

#include "bindings.h"

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
    pack_progress * p = (pack_progress *) ud;
    py::gil_scoped_acquire acquire;
    try {
        py::object r = p->fn(done, total);
        return r.is_none() || r.cast<bool>();
    } catch (...) {
        p->cancelled = true;
        return false;
    }
}

} // namespace

void register_store(py::module_ & m) {
    m.def("pack", [](const std::string & model_path, const std::string & out_dir, const std::string & low_type, py::object progress) {
        moetier_pack_params p = moetier_pack_default_params();
        p.low_type = low_type.c_str();
        pack_progress pp;
        if (!progress.is_none()) {
            pp.fn = progress;
            p.progress_callback = pack_progress_cb;
            p.progress_callback_user_data = &pp;
        }
        int32_t rc;
        {
            py::gil_scoped_release release;
            rc = moetier_pack(model_path.c_str(), out_dir.c_str(), p);
        }
        if (rc == -2) {
            throw std::runtime_error(out_dir + ": pack cancelled");
        }
        if (rc != 0) {
            throw std::runtime_error(moetier_last_error());
        }
    }, py::arg("model_path"), py::arg("out_dir"), py::arg("low_type") = "q4_0", py::arg("progress") = py::none(),
    "write the expert store of a GGUF MoE model (see moetier.h moetier_pack)");

    m.def("parse_size", [](const std::string & text) -> py::object {
        uint64_t v = 0;
        if (!moetier_parse_size(text.c_str(), &v)) {
            return py::none();
        }
        return py::int_(v);
    }, py::arg("text"), "bytes of a size like '512M', or None if text is not a size");

    m.def("policy_names", []() {
        std::vector<std::string> out;
        for (const char * const * n = moetier_policy_names(); *n; ++n) {
            out.push_back(*n);
        }
        return out;
    });

    m.def("check_opts", [](const std::string & opts) -> py::object {
        moetier_params p = moetier_default_params();
        const char * err = moetier_params_set_opts(&p, opts.c_str());
        return err ? py::object(py::str(err)) : py::object(py::none());
    }, py::arg("opts"), "None if the KEY=VALUE list of expert cache options is valid, else why not");

    m.def("default_params", []() {
        const moetier_params p = moetier_default_params();
        py::dict d;
        d["cache_bytes"] = p.cache_bytes;
        d["policy"]      = p.policy ? p.policy : "";
        d["direct_io"]   = p.direct_io;
        d["t1"]          = p.t1;
        d["t2"]          = p.t2;
        d["low_frac"]    = p.low_frac;
        d["w_lru"]       = p.w_lru;
        d["w_lfu"]       = p.w_lfu;
        d["w_lhu"]       = p.w_lhu;
        d["w_fld"]       = p.w_fld;
        d["prefetch"]    = p.prefetch;
        d["io_threads"]  = p.io_threads;
        d["io_uring"]    = p.io_uring;
        d["low_type"]    = moetier_pack_default_params().low_type;
        return d;
    });
}

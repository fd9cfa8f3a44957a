// moetier._core: the expert cache parameters (moetier_params) and the context parameters
// (llama_context_params) as bound structs, set by field name on the library's defaults, as
// llama-cpp-python does with llama_model_params; the option table behind them; sizes.

#include "bindings.h"
#include "ggml.h"
#include "llama.h"
#include "moetier.h"

#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// moetier_params with storage for its strings: the struct points into it
struct py_params {
    moetier_params p = moetier_default_params();
    std::string    store_dir;
    std::string    policy = p.policy ? p.policy : "";

    py_params() { p.policy = policy.c_str(); }

    py_params(const py_params & o) : p(o.p), store_dir(o.store_dir), policy(o.policy) { fix(); }

    py_params & operator=(const py_params &) = delete;

    void fix() {
        p.store_dir = store_dir.empty() ? nullptr : store_dir.c_str();
        p.policy    = policy.empty() ? nullptr : policy.c_str();
    }
};

const char * param_type_name(int32_t type) {
    switch (type) {
        case MOETIER_PARAM_TYPE_SIZE:
            return "size";
        case MOETIER_PARAM_TYPE_STRING:
            return "str";
        case MOETIER_PARAM_TYPE_FLOAT:
            return "float";
        case MOETIER_PARAM_TYPE_INT:
            return "int";
        case MOETIER_PARAM_TYPE_BOOL:
            return "bool";
        default:
            return "?";
    }
}

// a number field of moetier_params at offset off, as a property
template <typename T> void def_number(py::class_<py_params> & c, const moetier_param_info * info) {
    const size_t off = info->offset;
    c.def_property(
        info->name, [off](const py_params & x) { return *(const T *) ((const char *) &x.p + off); },
        [off](py_params & x, T v) { *(T *) ((char *) &x.p + off) = v; }, info->help);
}

// a string field of moetier_params, kept in py_params' storage
void def_string(py::class_<py_params> & c, const moetier_param_info * info, std::string py_params::*field) {
    c.def_property(
        info->name, [field](const py_params & x) { return x.*field; },
        [field](py_params & x, const std::string & v) {
            x.*field = v;
            x.fix();
        },
        info->help);
}

// one property per row of the option table, typed by the row
void def_param(py::class_<py_params> & c, const moetier_param_info * info) {
    switch (info->type) {
        case MOETIER_PARAM_TYPE_SIZE:
            def_number<uint64_t>(c, info);
            return;
        case MOETIER_PARAM_TYPE_FLOAT:
            def_number<float>(c, info);
            return;
        case MOETIER_PARAM_TYPE_INT:
            def_number<int32_t>(c, info);
            return;
        case MOETIER_PARAM_TYPE_BOOL:
            def_number<bool>(c, info);
            return;
        case MOETIER_PARAM_TYPE_STRING:
            if (strcmp(info->name, "store_dir") == 0) {
                def_string(c, info, &py_params::store_dir);
                return;
            }
            if (strcmp(info->name, "policy") == 0) {
                def_string(c, info, &py_params::policy);
                return;
            }
            throw std::logic_error(std::string("no string storage for parameter ") + info->name);
        default:
            throw std::logic_error(std::string("unknown type of parameter ") + info->name);
    }
}

// the types the KV cache can hold (llama.cpp's common/arg.cpp kv_cache_types): others fail deep in
// llama.cpp, or abort in compute
ggml_type kv_type_of(const char * what, const std::string & name) {
    static const ggml_type kv_types[] = {
        GGML_TYPE_F32,  GGML_TYPE_F16,    GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
        GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1,
    };
    std::string names;
    for (ggml_type t : kv_types) {
        if (name == ggml_type_name(t)) {
            return t;
        }
        names += std::string(names.empty() ? "" : ", ") + ggml_type_name(t);
    }
    throw moetier_py_error{ MOETIER_ERROR_CONFIG,
                            std::string(what) + ": '" + name + "' is not a KV cache type (one of " + names + ")" };
}

}  // namespace

// for register-model.cpp: the C struct behind a bound Params
const moetier_params & moetier_py_params_of(const py::object & o) {
    return o.cast<const py_params &>().p;
}

void register_params(py::module_ & m) {
    py::class_<py_params> params(m, "Params",
                                 "moetier_params: the expert cache of one model (defaults: moetier_default_params)");
    params.def(py::init<>());
    params.def("__copy__", [](const py_params & x) { return py_params(x); });
    for (int32_t i = 0; i < moetier_param_count(); ++i) {
        def_param(params, moetier_param_get(i));
    }
    params.def(
        "check",
        [](const py_params & x) -> py::object {
            const char * err = moetier_params_check(&x.p);
            return err ? py::object(py::str(err)) : py::object(py::none());
        },
        "None if the parameters are valid, else why not");
    params.def(
        "set_opts",
        [](py_params & x, const std::string & opts) {
            if (const char * err = moetier_params_set_opts(&x.p, opts.c_str())) {
                throw moetier_py_error{ MOETIER_ERROR_CONFIG, err };
            }
        },
        py::arg("opts"), "sets KEY=VALUE,... options as --expert-opt does");

    m.def(
        "param_table",
        []() {
            py::list out;
            for (int32_t i = 0; i < moetier_param_count(); ++i) {
                const moetier_param_info * info = moetier_param_get(i);
                py::dict                   d;
                d["name"]   = info->name;
                d["type"]   = param_type_name(info->type);
                d["min"]    = info->min;
                d["max"]    = info->max;
                d["is_opt"] = info->is_opt;
                d["help"]   = info->help;
                out.append(d);
            }
            return out;
        },
        "the option table of moetier_params: name, type, min, max, is_opt (a KEY=VALUE option), help");
    m.def(
        "params_help", []() { return std::string(moetier_params_help()); },
        "the --expert-opt help of the patched tools, from the option table");

    m.def(
        "check_opts",
        [](const std::string & opts) -> py::object {
            moetier_params p   = moetier_default_params();
            const char *   err = moetier_params_set_opts(&p, opts.c_str());
            return err ? py::object(py::str(err)) : py::object(py::none());
        },
        py::arg("opts"), "None if the KEY=VALUE list of expert cache options is valid, else why not");

    m.def(
        "parse_size",
        [](const std::string & text) -> py::object {
            uint64_t v = 0;
            if (!moetier_parse_size(text.c_str(), &v)) {
                return py::none();
            }
            return py::int_(v);
        },
        py::arg("text"), "bytes of a size like '512M', or None if text is not a size");

    m.def(
        "parse_cache_size",
        [](const std::string & text) -> py::object {
            uint64_t v = 0;
            if (!moetier_parse_cache_size(text.c_str(), &v)) {
                return py::none();
            }
            return py::int_(v);
        },
        py::arg("text"), "bytes of a budget like '512M', CACHE_AUTO for 'auto', or None if text is neither");
    m.attr("CACHE_AUTO") = py::int_((uint64_t) MOETIER_CACHE_AUTO);
    m.def(
        "memory_limit",
        [](const std::string & root) {
            char           source[512];
            const uint64_t n = moetier_memory_limit(root.c_str(), source, sizeof(source));
            return py::make_tuple(n, std::string(source));
        },
        py::arg("root") = "/",
        "(bytes, source): the memory this process may use: the lowest cgroup limit (v2 memory.max, v1 "
        "memory.limit_in_bytes) or MemAvailable; root: where /proc and /sys are (tests use a fake tree)");
    m.def(
        "memory_free", [](const std::string & root) { return moetier_memory_free(root.c_str()); },
        py::arg("root") = "/",
        "bytes an elastic expert cache may still take: the lowest cgroup limit minus that group's usage plus its "
        "inactive page cache, and MemAvailable, whichever is lower (0 if none can be read); root: as memory_limit");
    m.def(
        "format_size",
        [](uint64_t n) {
            char buf[64];
            moetier_format_size(n, buf, sizeof(buf));
            return std::string(buf);
        },
        py::arg("n"), "n bytes as text in powers of 1024, e.g. '3.25 MiB'");

    m.def("policy_names", []() {
        std::vector<std::string> out;
        for (const char * const * n = moetier_policy_names(); *n; ++n) {
            out.push_back(*n);
        }
        return out;
    });

    py::class_<llama_context_params> cp(
        m, "ContextParams", "llama_context_params of a Model's contexts (defaults: llama_context_default_params)");
    cp.def(py::init([]() {
        llama_context_params p = llama_context_default_params();
        p.no_perf              = true;
        return p;
    }));
    cp.def_readwrite("n_ctx", &llama_context_params::n_ctx, "context length in tokens");
    cp.def_readwrite("n_batch", &llama_context_params::n_batch, "logical batch size");
    cp.def_readwrite("n_ubatch", &llama_context_params::n_ubatch, "physical batch size (tokens per graph run)");
    cp.def_property(
        "n_threads", [](const llama_context_params & p) { return p.n_threads; },
        [](llama_context_params & p, int32_t n) {
            p.n_threads       = n;
            p.n_threads_batch = n;
        },
        "compute threads, for generation and batches alike");
    cp.def_property(
        "type_k", [](const llama_context_params & p) { return std::string(ggml_type_name(p.type_k)); },
        [](llama_context_params & p, const std::string & v) { p.type_k = kv_type_of("type_k", v); },
        "KV cache type of the keys (a ggml type name)");
    cp.def_property(
        "type_v", [](const llama_context_params & p) { return std::string(ggml_type_name(p.type_v)); },
        [](llama_context_params & p, const std::string & v) { p.type_v = kv_type_of("type_v", v); },
        "KV cache type of the values (a ggml type name)");
    cp.def_property(
        "flash_attn", [](const llama_context_params & p) { return (int) p.flash_attn_type; },
        [](llama_context_params & p, int v) {
            if (v < -1 || v > 1) {
                throw moetier_py_error{ MOETIER_ERROR_CONFIG, "flash_attn: expected -1 (auto), 0 (off) or 1 (on)" };
            }
            p.flash_attn_type = (llama_flash_attn_type) v;
        },
        "flash attention: -1 auto, 0 off, 1 on");
}

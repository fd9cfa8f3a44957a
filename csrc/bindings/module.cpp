// moetier._core: the thin compiled layer under the moetier Python package, one register_* per concept.

#include "bindings.h"
#include "llama.h"

PYBIND11_MODULE(_core, m) {
    m.doc() = "moetier native core: expert cache, store and llama.cpp model bindings";
    llama_backend_init();
    register_errors(m);
    register_log(m);
    register_params(m);
    register_model(m);
    register_trace(m);
    register_store(m);
    register_ops(m);
    register_policy(m);
}

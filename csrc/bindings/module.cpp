// moetier._core: the thin compiled layer under the moetier Python package.

#include "bindings.h"

#include "llama.h"

PYBIND11_MODULE(_core, m) {
    m.doc() = "moetier native core: expert cache, store and llama.cpp model bindings";
    llama_backend_init();
    register_log(m);
    register_model(m);
    register_store(m);
    register_ops(m);
    register_policy(m);
}

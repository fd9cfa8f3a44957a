#include "moetier-hooks.h"

#include "llama-model.h"
#include "llama.h"
#include "moetier-configure.h"
#include "moetier-impl.h"
#include "moetier-model.h"

void moetier_model_deleter::operator()(moetier_model * m) const {
    delete m;
}

//
// load hooks (the graph hooks are in moetier-graph.cpp): exceptions go on to llama.cpp's loader, the C API's last error keeps message and kind
//

moetier_model_ptr moetier_hook_model_init(const std::string &              fname,
                                          const std::vector<std::string> & splits,
                                          int *                            load_mode) {
    moetier_set_last_error(MOETIER_ERROR_NONE, "");
    moetier_params_copy params;
    if (!moetier_pending_take(fname, params) && (splits.empty() || !moetier_pending_take(splits[0], params))) {
        return nullptr;
    }
    try {
        std::vector<std::string> paths = splits.empty() ? std::vector<std::string>{ fname } : splits;
        moetier_model_ptr        m(new moetier_model(params.p, paths));
        // mmap stays (the loader excludes served experts from the mapping's prefetch), so the other
        // weights are paged like stock's; but mlock of the mapping would fault the experts in
        if (*load_mode == LLAMA_LOAD_MODE_MMAP_MLOCK) {
            *load_mode = LLAMA_LOAD_MODE_MLOCK;
        }
        return m;
    } catch (const std::exception & e) {
        moetier_set_last_error(moetier_error_kind_of(e), e.what());
        throw;
    }
}

ggml_tensor * moetier_hook_create_tensor(moetier_model *                                     m,
                                         const std::string &                                 name,
                                         const ggml_tensor *                                 cur,
                                         uint16_t                                            file_idx,
                                         size_t                                              offs,
                                         const std::function<ggml_backend_buffer_type *()> & buft) {
    if (m == nullptr) {
        return nullptr;
    }
    try {
        return m->create_tensor(name, cur, file_idx, offs, buft);
    } catch (const std::exception & e) {
        moetier_set_last_error(moetier_error_kind_of(e), e.what());
        throw;
    }
}

void moetier_hook_model_loaded(llama_model & model) {
    moetier_model * m = model.moetier.get();
    if (m == nullptr) {
        return;
    }
    try {
        m->check_served();
        m->choose_budget(model);
        m->lock_resident_weights(model);
        m->finish_load(model);
        m->init_routing(model);
        m->init_io();
        m->init_prefetch(model);
        m->init_warm();
        if (!model.hparams.no_alloc) {
            m->start_populate();
        }
    } catch (const std::exception & e) {
        moetier_set_last_error(moetier_error_kind_of(e), m->paths[0] + ": " + e.what());
        throw std::runtime_error(moetier_last_error());
    }
}

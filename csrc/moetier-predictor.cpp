#include "moetier-predictor.h"

#include "moetier-impl.h"
#include "moetier-store.h"

#include <cinttypes>
#include <cstdio>
#include <stdexcept>

std::string moetier_predictor_path(const std::string & model_path, const std::string & store_dir) {
    return store_dir.empty() ? model_path + ".predictor.gguf" : store_dir + "/predictor.gguf";
}

std::string moetier_predictor_model_key(const std::string & model_path) {
    const moetier_model_identity id = moetier_model_identity_compute(model_path);
    return format("%" PRIu64 ":%016" PRIx64 ":%016" PRIx64, id.file_size, id.header_checksum, id.sample_checksum);
}

static std::string gguf_string(const gguf_context * g, const char * key) {
    const int64_t i = gguf_find_key(g, key);
    return i >= 0 && gguf_get_kv_type(g, i) == GGUF_TYPE_STRING ? gguf_get_val_str(g, i) : "";
}

moetier_predictor_file::moetier_predictor_file(const std::string & path,
                                               const std::string & model_key,
                                               int64_t             n_embd,
                                               int64_t             n_expert) {
    ggml_context *   c  = nullptr;
    gguf_init_params ip = { /*.no_alloc =*/false, /*.ctx =*/&c };
    gguf.reset(gguf_init_from_file(path.c_str(), ip));
    ctx.reset(c);
    if (!gguf) {
        throw std::runtime_error(format("%s: not a readable GGUF file", path.c_str()));
    }
    if (gguf_string(gguf.get(), "general.architecture") != "moetier-predictor") {
        throw std::runtime_error(
            format("%s: not a prefetch predictor (general.architecture is not moetier-predictor)", path.c_str()));
    }
    const std::string key = gguf_string(gguf.get(), "moetier-predictor.model");
    if (key != model_key) {
        throw std::runtime_error(
            format("%s: fitted on another model (%s, this one is %s)", path.c_str(), key.c_str(), model_key.c_str()));
    }
    // the file's tensors (the context also holds the blob their data lives in)
    for (int64_t i = 0; i < gguf_get_n_tensors(gguf.get()); ++i) {
        const ggml_tensor * t  = ggml_get_tensor(ctx.get(), gguf_get_tensor_name(gguf.get(), i));
        int32_t             il = -1, d = -1, n = 0;
        char                kind[8] = { 0 };
        if (sscanf(t->name, "blk.%d.pred.%d.%7[a-z]%n", &il, &d, kind, &n) != 3 || t->name[n] != '\0' || il < 0 ||
            d < 1 || t->type != GGML_TYPE_F32) {
            throw std::runtime_error(
                format("%s: unexpected tensor %s (blk.L.pred.D.weight|bias, F32)", path.c_str(), t->name));
        }
        const std::string k(kind);
        const bool        ok = (k == "weight" && t->ne[0] == n_embd && t->ne[1] == n_expert && ggml_n_dims(t) == 2) ||
                        (k == "bias" && t->ne[0] == n_expert && ggml_n_dims(t) == 1);
        if (!ok) {
            throw std::runtime_error(format("%s: %s has shape [%" PRId64 ", %" PRId64 "]; the model needs [%" PRId64
                                            ", %" PRId64 "] weights and [%" PRId64 "] biases",
                                            path.c_str(), t->name, t->ne[0], t->ne[1], n_embd, n_expert, n_expert));
        }
    }
}

const ggml_tensor * moetier_predictor_file::weight(int32_t il, int32_t d) const {
    return ggml_get_tensor(ctx.get(), format("blk.%d.pred.%d.weight", il, d).c_str());
}

const float * moetier_predictor_file::bias(int32_t il, int32_t d) const {
    const ggml_tensor * t = ggml_get_tensor(ctx.get(), format("blk.%d.pred.%d.bias", il, d).c_str());
    return t ? (const float *) t->data : nullptr;
}

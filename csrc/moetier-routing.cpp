#include "moetier-routing.h"

#include "moetier-impl.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>

moetier_routing::moetier_routing(const std::string & path) : path_(path) {
    std::unique_ptr<FILE, int (*)(FILE *)> f(fopen(path.c_str(), "rb"), fclose);
    if (!f) {
        throw std::runtime_error(format("%s: cannot open the routing trace", path.c_str()));
    }
    char     magic[4];
    uint32_t head[5];
    if (fread(magic, 1, 4, f.get()) != 4 || memcmp(magic, "MTRT", 4) != 0 || fread(head, 4, 5, f.get()) != 5 ||
        head[0] != 1) {
        throw std::runtime_error(
            format("%s: not a routing trace (version 1 of bench/gpu.py's format, \"MTRT\")", path.c_str()));
    }
    n_tokens_ = (int32_t) head[1];
    n_layers_ = (int32_t) head[2];
    n_used_   = (int32_t) head[3];
    n_expert_ = (int32_t) head[4];
    if (n_tokens_ < 1 || n_layers_ < 1 || n_used_ < 1 || n_expert_ < n_used_ || n_expert_ > 65535) {
        throw std::runtime_error(
            format("%s: routing trace of %d tokens x %d layers x top-%d of %d experts: not a "
                   "geometry",
                   path.c_str(), n_tokens_, n_layers_, n_used_, n_expert_));
    }
    data.resize((size_t) n_tokens_ * n_layers_ * n_used_);
    if (fread(data.data(), sizeof(uint16_t), data.size(), f.get()) != data.size()) {
        throw std::runtime_error(format("%s: routing trace is short (%zu ids expected)", path.c_str(), data.size()));
    }
    for (size_t i = 0; i < data.size(); ++i) {
        if (data[i] >= n_expert_) {
            throw std::runtime_error(format("%s: routing trace id %u at position %zu is out of range (%d experts)",
                                            path.c_str(), data[i], i, n_expert_));
        }
        for (size_t j = i - i % n_used_; j < i; ++j) {
            if (data[j] == data[i]) {
                throw std::runtime_error(
                    format("%s: routing trace row %zu names expert %u twice (a token's experts "
                           "are distinct)",
                           path.c_str(), i / n_used_, data[i]));
            }
        }
    }
}

const int32_t * moetier_routing::ids(int32_t li, int64_t n_tokens) {
    if (li == 0) {
        cursor = next;
        next   = (cursor + n_tokens) % n_tokens_;
    }
    scratch.resize((size_t) n_tokens * n_used_);
    const int32_t l = li % n_layers_;
    for (int64_t t = 0; t < n_tokens; ++t) {
        const uint16_t * row = data.data() + (((cursor + t) % n_tokens_) * n_layers_ + l) * n_used_;
        for (int32_t k = 0; k < n_used_; ++k) {
            scratch[(size_t) t * n_used_ + k] = row[k];
        }
    }
    return scratch.data();
}

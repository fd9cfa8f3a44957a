#include "moetier-params.h"

#include "moetier-impl.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>

// clang-format off
#define MOETIER_ROW(field, type, lo, hi, opt, help) \
    { #field, type, lo, hi, opt, help, offsetof(moetier_params, field) }

static const moetier_param_info g_rows[] = {
    MOETIER_ROW(cache_bytes, MOETIER_PARAM_TYPE_SIZE, 0, 1.8446744073709552e19, false,
            "expert cache size in bytes, e.g. 256M or 2G, or auto (from the memory limit); at least one layer's "
            "experts; 0 = cache off"),
    MOETIER_ROW(reserve, MOETIER_PARAM_TYPE_SIZE, 0, 1.8e19, true,
            "auto budget: memory left free beside what the model, KV cache and compute buffers need (e.g. for "
            "other processes)"),
    MOETIER_ROW(vram, MOETIER_PARAM_TYPE_SIZE, 0, 1.8446744073709552e19, true,
            "VRAM tier: bytes of experts cached in the memory of the GPU each layer runs on (-ngl), over the RAM cache, "
            "e.g. 4G, or auto (the GPU's free memory at load less the KV cache, compute buffers and a margin); at least "
            "one layer's experts; a VRAM miss is copied from the RAM tier (read first on a RAM miss) "
            "and every expert computes on the GPU; with mixed precision (t1 < t2) low_frac of it holds low-precision "
            "copies; 0 = off: the experts compute on the CPU from the RAM cache"),
    MOETIER_ROW(store_dir, MOETIER_PARAM_TYPE_STRING, 0, 0, false,
            "expert store written by `moetier pack`; none = read experts from the GGUF"),
    MOETIER_ROW(policy, MOETIER_PARAM_TYPE_STRING, 0, 0, false,
            "eviction policy: lru, lfu, lhu (high-precision uses), fld (layer distance), multi (their weighted sum), "
            "random, classlru (decayed use classes, as upstream llama.cpp), lfru (uses over recency), least-stale "
            "(what this forward pass already used goes first), reuse (the longest expected time to next use, from "
            "layer distance and use frequency decayed over 64 passes; reuse:H another half-life), reuse-rank (reuse with "
            "the next use's probability learned online from the gate rank at the last use and the passes since; "
            "frequency half-life 16, reuse-rank:H another), reuse-learned (reuse with the next use's probability "
            "learned online from the passes since the last use, the use frequency over 16 and 256 passes and the gate "
            "rank, jointly; reuse-learned:H another fast half-life), flashmoe:NET (FlashMoE's learned policy: a network "
            "written by moetier train-policy)"),
    MOETIER_ROW(t1, MOETIER_PARAM_TYPE_FLOAT, 0, 1, true,
            "precision threshold of a miss (HOBBIT eq. 2): an expert whose score (the normalised gate weight of the "
            "experts ranked above it) is <= t1 is read in high precision; the top-1 always is"),
    MOETIER_ROW(t2, MOETIER_PARAM_TYPE_FLOAT, 0, 1, true,
            "score <= t2: read the low-precision version (needs a store); above: skip the expert. t1 = t2 = 1 keeps "
            "every expert in high precision (output equals stock llama.cpp)"),
    MOETIER_ROW(low_frac, MOETIER_PARAM_TYPE_FLOAT, 0, 0.999999, true,
            "share of the budget for low-precision slots (used with a store and t1 < t2)"),
    MOETIER_ROW(w_lru, MOETIER_PARAM_TYPE_FLOAT, 0, 1e9, true, "policy multi: weight of recency"),
    MOETIER_ROW(w_lfu, MOETIER_PARAM_TYPE_FLOAT, 0, 1e9, true, "policy multi: weight of use frequency in the sequence"),
    MOETIER_ROW(w_lhu, MOETIER_PARAM_TYPE_FLOAT, 0, 1e9, true,
            "policy multi: weight of high-precision use frequency in the sequence"),
    MOETIER_ROW(w_fld, MOETIER_PARAM_TYPE_FLOAT, 0, 1e9, true,
            "policy multi: weight of layer distance (the layer that just ran is evicted first)"),
    MOETIER_ROW(prefetch, MOETIER_PARAM_TYPE_INT, 0, MOETIER_MAX_PREFETCH, true,
            "layers predicted ahead by the stacked routers of the next layers (HOBBIT sec. 3.3); their missing "
            "experts are read in the background; 0 = off"),
    MOETIER_ROW(io_threads, MOETIER_PARAM_TYPE_INT, 0, 64, true,
            "prefetch lanes: with io_uring, prefetch reads in flight on the ring; without it, I/O threads (they sleep "
            "when idle) that read prefetches while the compute threads read a layer's misses. A prefetch walk starts "
            "at most this many reads, the surest predictions first. 0: no I/O pool at all: the compute threads read "
            "every miss, no io_uring, no prefetch"),
    MOETIER_ROW(prefetch_waste, MOETIER_PARAM_TYPE_FLOAT, 0, 100, true,
            "prefetch byte cap: the bytes of prefetch reads that their layer then does not use stay below this share "
            "of the bytes the layers need (their misses and the prefetches they use); a read holds its bytes of this "
            "allowance until its layer runs. 0: prefetch holds predicted cached experts but reads none"),
    MOETIER_ROW(n_ctx, MOETIER_PARAM_TYPE_INT, 0, 1 << 24, true,
            "auto budget: context tokens whose KV cache is left room for (0: the model's training context; the "
            "tools pass their -c)"),
    MOETIER_ROW(io_uring, MOETIER_PARAM_TYPE_BOOL, 0, 1, true,
            "read with io_uring where the kernel allows it and experts are read with O_DIRECT (a store's straight "
            "into the slots, a GGUF's through staging buffers): the kernel reads while the compute threads run, no "
            "I/O thread takes their cores; off (0): the compute threads read misses, I/O threads prefetch"),
    MOETIER_ROW(direct_io, MOETIER_PARAM_TYPE_BOOL, 0, 1, true,
            "read experts with O_DIRECT (bypass the page cache); falls back to buffered reads with a warning"),
    MOETIER_ROW(warm, MOETIER_PARAM_TYPE_BOOL, 0, 1, true,
            "warm start: the cache's hot state is kept in a sidecar next to the store (<store>/cache-state.bin, or "
            "<model>.cache-state); at load its hottest experts are read in the background; written at exit and "
            "every minute of decoding; a missing, stale or corrupt one is ignored with a warning"),
    MOETIER_ROW(fitted_prefetch, MOETIER_PARAM_TYPE_BOOL, 0, 1, true,
            "prefetch: predict with the fitted predictor where there is one (<store>/predictor.gguf or "
            "<model>.predictor.gguf, written by `moetier fit-predictor`: a linear map per layer and distance, in "
            "place of the next layers' routers); a stale or unreadable one is ignored with a warning; 0: the routers"),
    MOETIER_ROW(lock_weights, MOETIER_PARAM_TYPE_BOOL, 0, 1, true,
            "lock the memory-mapped non-expert weights in RAM (mlock; the token embeddings stay paged): every token "
            "reads them, so under memory pressure paging them costs a disk read of each per token. Needs a locked-"
            "memory limit that covers them (ulimit -l; root has none); refused -> a warning and paged weights"),
    MOETIER_ROW(verify_all, MOETIER_PARAM_TYPE_BOOL, 0, 1, true,
            "check every expert read of a store against the store's checksums before its slot is used (CRC32C "
            "with the CPU's CRC instructions, at memory speed); 0: only the first read of each expert copy in "
            "this process, trusted after (a damaged file then goes unnoticed on later reads)"),
    MOETIER_ROW(vram_cpu, MOETIER_PARAM_TYPE_BOOL, 0, 1, true,
            "cooperative compute under the VRAM tier: in decode, the CPU computes the VRAM misses that cost less "
            "there than a copy (the coldest first; the costs are measured at load), from the RAM tier, while the GPU "
            "computes the rest, the results added; where an expert computes may change the output's last bits"),
    MOETIER_ROW(vram_host, MOETIER_PARAM_TYPE_BOOL, 0, 1, true,
            "the VRAM tier's pools in host memory instead of a GPU's: the same bookkeeping, copies and graph, computed "
            "on the CPU (checks the tier where no GPU is; slower than vram=0)"),
    MOETIER_ROW(prefetch_gate, MOETIER_PARAM_TYPE_BOOL, 0, 1, true,
            "prefetch measures whether it pays where it runs: decode steps go in windows of 2, prefetch reading and "
            "standing back (the policy alone) in the order ABBA, 64 at a time; prefetch reads on only if its mean "
            "step time is lower, by two standard errors (or after 192 steps); the chosen arm runs the next 256 steps "
            "per 64 measured, then both "
            "are measured again (a fast disk may hide reads behind compute already, and then wasted prefetch reads "
            "only cost time); 0: prefetch always reads"),
    MOETIER_ROW(huge_pages, MOETIER_PARAM_TYPE_BOOL, 0, 1, true,
            "the RAM tier's slot pools in transparent huge pages (MADV_HUGEPAGE; needs THP enabled as always or "
            "madvise): the experts compute with fewer TLB misses once cached, and a background thread at the lowest "
            "priority faults fresh slots in ahead of the misses. Off by default: where fresh huge pages fault in "
            "slowly (in a VM whose host backs each on first touch) the cache's first fill is slower"),
    MOETIER_ROW(grow, MOETIER_PARAM_TYPE_INT, -1, 1, true,
            "elastic budget: the cache grows past its budget into memory the memory limit leaves free (the cgroup "
            "limit less what the group holds beside reclaimable page cache, and MemAvailable), up to every expert, "
            "and gives it back, down to its budget, when free memory runs short: it keeps between 1/32 of the "
            "limit (16 MiB at least) plus reserve and twice that free, checked every 100 ms of decoding, as the "
            "page cache holds the experts of a memory-mapped model. -1: on for an auto budget, off for a given one; "
            "1: on (a given budget is the least the cache keeps); 0: off. A RAM tier under a VRAM tier and variants "
            "sharing a cache keep a fixed budget"),
};

#undef MOETIER_ROW
// clang-format on

static constexpr int32_t MOETIER_N_PARAMS = (int32_t) (sizeof(g_rows) / sizeof(g_rows[0]));

struct moetier_params moetier_default_params(void) {
    moetier_params p = {
        /*.cache_bytes =*/0,
        /*.reserve     =*/0,
        /*.vram        =*/0,
        /*.store_dir   =*/nullptr,
        /*.policy      =*/"reuse-rank",
        /*.t1          =*/1.0f,
        /*.t2          =*/1.0f,
        /*.low_frac    =*/0.25f,
        /*.w_lru       =*/0.25f,
        /*.w_lfu       =*/0.25f,
        /*.w_lhu       =*/0.25f,
        /*.w_fld       =*/0.25f,
        /*.prefetch    =*/3,
        /*.io_threads  =*/6,
        /*.prefetch_waste=*/0.25f,
        /*.n_ctx       =*/0,
        /*.grow        =*/-1,
        /*.io_uring    =*/true,
        /*.direct_io   =*/true,
        /*.warm        =*/true,
        /*.fitted_prefetch=*/true,
        /*.lock_weights=*/true,
        /*.verify_all  =*/true,
        /*.vram_cpu    =*/false,
        /*.vram_host   =*/false,
        /*.prefetch_gate=*/true,
        /*.huge_pages  =*/false,
    };
    return p;
}

int32_t moetier_param_count(void) {
    return MOETIER_N_PARAMS;
}

const struct moetier_param_info * moetier_param_get(int32_t i) {
    return i >= 0 && i < MOETIER_N_PARAMS ? &g_rows[i] : nullptr;
}

const moetier_param_info * moetier_param_find(const std::string & name) {
    for (const auto & r : g_rows) {
        if (name == r.name) {
            return &r;
        }
    }
    return nullptr;
}

static void * moetier_param_field(moetier_params * p, const moetier_param_info * info) {
    return (uint8_t *) p + info->offset;
}

static const void * moetier_param_field(const moetier_params * p, const moetier_param_info * info) {
    return moetier_param_field(const_cast<moetier_params *>(p), info);
}

// the value of a numeric field as a double
static double moetier_param_value(const moetier_params * p, const moetier_param_info * info) {
    const void * f = moetier_param_field(p, info);
    switch (info->type) {
        case MOETIER_PARAM_TYPE_SIZE:
            return (double) *(const uint64_t *) f;
        case MOETIER_PARAM_TYPE_FLOAT:
            return *(const float *) f;
        case MOETIER_PARAM_TYPE_INT:
            return *(const int32_t *) f;
        case MOETIER_PARAM_TYPE_BOOL:
            return *(const bool *) f ? 1.0 : 0.0;
        default:
            return 0.0;
    }
}

static std::string moetier_param_text(const moetier_params * p, const moetier_param_info * info) {
    const void * f = moetier_param_field(p, info);
    switch (info->type) {
        case MOETIER_PARAM_TYPE_SIZE:
            return *(const uint64_t *) f == MOETIER_CACHE_AUTO ? "auto" : moetier_format_bytes(*(const uint64_t *) f);
        case MOETIER_PARAM_TYPE_STRING:
            return *(const char * const *) f ? *(const char * const *) f : "none";
        case MOETIER_PARAM_TYPE_FLOAT:
            return format("%g", *(const float *) f);
        case MOETIER_PARAM_TYPE_INT:
            return format("%d", *(const int32_t *) f);
        case MOETIER_PARAM_TYPE_BOOL:
            return *(const bool *) f ? "1" : "0";
        default:
            return "";
    }
}

const char * moetier_params_help(void) {
    // built once from the table and the defaults: the tools' --expert-opt help repeats nothing
    static const std::string help = [] {
        const moetier_params d = moetier_default_params();
        std::string          out;
        for (const auto & r : g_rows) {
            if (!r.is_opt) {
                continue;
            }
            out += format("%s- %s: %s (default %s)", out.empty() ? "" : "\n", r.name, r.help,
                          moetier_param_text(&d, &r).c_str());
        }
        return out;
    }();
    return help.c_str();
}

bool moetier_parse_size(const char * text, uint64_t * out) {
    if (text == nullptr || out == nullptr) {
        return false;
    }
    std::string s(text);
    while (!s.empty() && isspace((unsigned char) s.back())) {
        s.pop_back();
    }
    size_t i = 0;
    while (i < s.size() && (isdigit((unsigned char) s[i]) || s[i] == '.')) {
        ++i;
    }
    if (i == 0 || std::count(s.begin(), s.begin() + i, '.') > 1) {
        return false;
    }
    const double value = strtod(s.substr(0, i).c_str(), nullptr);
    std::string  unit  = s.substr(i);
    while (!unit.empty() && unit[0] == ' ') {
        unit.erase(0, 1);
    }
    for (auto & c : unit) {
        c = (char) toupper((unsigned char) c);
    }
    if (unit.size() >= 2 && unit.compare(unit.size() - 2, 2, "IB") == 0) {
        unit.resize(unit.size() - 2);
    } else if (unit.size() >= 2 && unit.back() == 'B') {
        unit.pop_back();
    } else if (unit == "B") {
        unit.clear();
    }
    double mult = 1.0;
    if (unit.empty()) {
        mult = 1.0;
    } else if (unit == "K") {
        mult = 1024.0;
    } else if (unit == "M") {
        mult = 1024.0 * 1024.0;
    } else if (unit == "G") {
        mult = 1024.0 * 1024.0 * 1024.0;
    } else if (unit == "T") {
        mult = 1024.0 * 1024.0 * 1024.0 * 1024.0;
    } else {
        return false;
    }
    const double bytes = value * mult;
    if (!(bytes >= 0.0) || bytes > 1.8e19) {
        return false;
    }
    *out = (uint64_t) bytes;
    return true;
}

bool moetier_parse_cache_size(const char * text, uint64_t * out) {
    if (text != nullptr && out != nullptr && strcmp(text, "auto") == 0) {
        *out = MOETIER_CACHE_AUTO;
        return true;
    }
    return moetier_parse_size(text, out);
}

int32_t moetier_format_size(uint64_t n, char * buf, size_t buf_size) {
    const std::string s = moetier_format_bytes(n);
    if (buf && buf_size > 0) {
        const size_t k = std::min(s.size(), buf_size - 1);
        memcpy(buf, s.data(), k);
        buf[k] = '\0';
    }
    return (int32_t) s.size();
}

const struct moetier_params * moetier_params_from_strings(struct moetier_params * p,
                                                          const char *            store_dir,
                                                          const char *            policy) {
    p->store_dir = store_dir && store_dir[0] ? store_dir : nullptr;
    p->policy    = policy && policy[0] ? policy : moetier_default_params().policy;
    return p;
}

static thread_local std::string g_opts_error;

static std::string moetier_opt_keys() {
    std::string keys;
    for (const auto & r : g_rows) {
        if (r.is_opt) {
            keys += format("%s%s", keys.empty() ? "" : ", ", r.name);
        }
    }
    return keys;
}

// sets one KEY=VALUE option; "" on success, else why not
static std::string moetier_params_set_opt(moetier_params * p, const std::string & key, const std::string & value) {
    const moetier_param_info * info = moetier_param_find(key);
    if (info == nullptr || !info->is_opt) {
        return format("expert cache option '%s': unknown KEY; expected one of %s", key.c_str(),
                      moetier_opt_keys().c_str());
    }
    void * f    = moetier_param_field(p, info);
    char * rest = nullptr;
    switch (info->type) {
        case MOETIER_PARAM_TYPE_SIZE:
            // vram takes auto as the cache budget does
            if (!(key == "vram" ? moetier_parse_cache_size : moetier_parse_size)(value.c_str(), (uint64_t *) f)) {
                return format("expert cache option %s: '%s' is not a size (e.g. 512M)%s", key.c_str(), value.c_str(),
                              key == "vram" ? " or auto" : "");
            }
            return "";
        case MOETIER_PARAM_TYPE_FLOAT:
            {
                const float v = strtof(value.c_str(), &rest);
                if (value.empty() || rest == nullptr || *rest != '\0' || std::isnan(v)) {
                    return format("expert cache option %s: '%s' is not a number", key.c_str(), value.c_str());
                }
                *(float *) f = v;
                return "";
            }
        case MOETIER_PARAM_TYPE_INT:
            {
                const long v = strtol(value.c_str(), &rest, 10);
                if (value.empty() || rest == nullptr || *rest != '\0') {
                    return format("expert cache option %s: '%s' is not an integer", key.c_str(), value.c_str());
                }
                *(int32_t *) f = (int32_t) std::max(-1L, std::min(v, 1L << 20));  // the range check follows
                return "";
            }
        case MOETIER_PARAM_TYPE_BOOL:
            {
                if (value == "1" || value == "true") {
                    *(bool *) f = true;
                } else if (value == "0" || value == "false") {
                    *(bool *) f = false;
                } else {
                    return format("expert cache option %s: '%s' must be 0 or 1", key.c_str(), value.c_str());
                }
                return "";
            }
        default:
            return format("expert cache option %s: not a KEY=VALUE option", key.c_str());
    }
}

const char * moetier_params_set_opts(struct moetier_params * p, const char * opts) {
    const std::string all = opts ? opts : "";
    size_t            pos = 0;
    while (pos <= all.size()) {
        size_t end = all.find(',', pos);
        if (end == std::string::npos) {
            end = all.size();
        }
        std::string item = all.substr(pos, end - pos);
        pos              = end + 1;
        item.erase(0, item.find_first_not_of(' '));
        item.erase(item.find_last_not_of(' ') + 1);
        if (item.empty()) {
            continue;
        }
        const size_t eq = item.find('=');
        if (eq == std::string::npos) {
            g_opts_error = format("expert cache option '%s': expected KEY=VALUE with KEY one of %s", item.c_str(),
                                  moetier_opt_keys().c_str());
            return g_opts_error.c_str();
        }
        g_opts_error = moetier_params_set_opt(p, item.substr(0, eq), item.substr(eq + 1));
        if (!g_opts_error.empty()) {
            return g_opts_error.c_str();
        }
    }
    return moetier_params_check(p);
}

const char * moetier_params_check(const struct moetier_params * p) {
    // ranges from the table, then the rules that tie fields together
    for (const auto & r : g_rows) {
        const moetier_param_info & info = r;
        if (info.type == MOETIER_PARAM_TYPE_STRING || info.type == MOETIER_PARAM_TYPE_BOOL) {
            continue;
        }
        const double v = moetier_param_value(p, &info);
        if (!(v >= info.min && v <= info.max)) {
            g_opts_error = format("expert cache %s=%s: must lie in [%g, %g]", info.name,
                                  moetier_param_text(p, &info).c_str(), info.min, info.max);
            return g_opts_error.c_str();
        }
    }
    if (p->t2 < p->t1) {
        g_opts_error = format("expert cache thresholds t1=%g > t2=%g: t1 must not exceed t2", p->t1, p->t2);
    } else if (p->w_lru + p->w_lfu + p->w_lhu + p->w_fld <= 0.0f) {
        g_opts_error = format("expert cache policy weights (w_lru=%g, w_lfu=%g, w_lhu=%g, w_fld=%g): must not all be 0",
                              p->w_lru, p->w_lfu, p->w_lhu, p->w_fld);
    } else {
        return nullptr;
    }
    return g_opts_error.c_str();
}

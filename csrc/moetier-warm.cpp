#include "moetier-warm.h"

#include "moetier-read.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>

// file: magic, version, identity, n_layers, n_expert, layers[n_layers], then per layer and expert
// uses (u32), last (u64), resident (u8), and the checksum of everything before it (u64)
static constexpr char     MOETIER_WARM_MAGIC[8] = { 'M', 'O', 'E', 'W', 'A', 'R', 'M', '1' };
static constexpr uint32_t MOETIER_WARM_VERSION  = 1;

template <typename T> static void moetier_put(std::string & out, const T & v) {
    out.append((const char *) &v, sizeof(T));
}

template <typename T> static bool moetier_get(const std::string & in, size_t & pos, T & v) {
    if (pos + sizeof(T) > in.size()) {
        return false;
    }
    memcpy(&v, in.data() + pos, sizeof(T));
    pos += sizeof(T);
    return true;
}

bool moetier_warm_load(const std::string &          path,
                       uint64_t                     identity,
                       const std::vector<int32_t> & layers,
                       int32_t                      n_expert,
                       moetier_warm_state &         out,
                       std::string &                why) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        why = "no sidecar yet";
        return false;
    }
    const std::string in((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (in.size() < sizeof(MOETIER_WARM_MAGIC) + 8 || memcmp(in.data(), MOETIER_WARM_MAGIC, 8) != 0) {
        why = "not a moetier warm-start sidecar (bad magic)";
        return false;
    }
    uint64_t sum = 0;
    memcpy(&sum, in.data() + in.size() - 8, 8);
    if (sum != moetier_checksum(in.data(), in.size() - 8)) {
        why = "corrupt (checksum mismatch)";
        return false;
    }
    size_t   pos     = 8;
    uint32_t version = 0, n_layers = 0;
    int32_t  n_exp = 0;
    if (!moetier_get(in, pos, version) || version != MOETIER_WARM_VERSION) {
        why = format("version %u, expected %u", version, MOETIER_WARM_VERSION);
        return false;
    }
    if (!moetier_get(in, pos, out.identity) || !moetier_get(in, pos, n_layers) || !moetier_get(in, pos, n_exp)) {
        why = "truncated header";
        return false;
    }
    if (out.identity != identity) {
        why = "stale: written for another model or expert store";
        return false;
    }
    if (n_layers != layers.size() || n_exp != n_expert) {
        why = format("stale: %u layers of %d experts, the model serves %zu of %d", n_layers, n_exp, layers.size(),
                     n_expert);
        return false;
    }
    out.n_expert = n_exp;
    out.layers.resize(n_layers);
    for (auto & il : out.layers) {
        if (!moetier_get(in, pos, il)) {
            why = "truncated";
            return false;
        }
    }
    if (out.layers != layers) {
        why = "stale: other served layers";
        return false;
    }
    const size_t n = (size_t) n_layers * n_expert;
    out.uses.resize(n);
    out.last.resize(n);
    out.resident.resize(n);
    for (size_t i = 0; i < n; ++i) {
        if (!moetier_get(in, pos, out.uses[i]) || !moetier_get(in, pos, out.last[i]) ||
            !moetier_get(in, pos, out.resident[i])) {
            why = "truncated";
            return false;
        }
    }
    if (pos + 8 != in.size()) {
        why = "corrupt (trailing bytes)";
        return false;
    }
    return true;
}

bool moetier_warm_save(const std::string & path, const moetier_warm_state & s, std::string & err) {
    std::string out(MOETIER_WARM_MAGIC, 8);
    moetier_put(out, MOETIER_WARM_VERSION);
    moetier_put(out, s.identity);
    moetier_put(out, (uint32_t) s.layers.size());
    moetier_put(out, s.n_expert);
    for (const int32_t il : s.layers) {
        moetier_put(out, il);
    }
    for (size_t i = 0; i < s.uses.size(); ++i) {
        moetier_put(out, s.uses[i]);
        moetier_put(out, s.last[i]);
        moetier_put(out, s.resident[i]);
    }
    moetier_put(out, moetier_checksum(out.data(), out.size()));
    // a name of this writer's own: two models on one store may save at once
    const std::string tmp = format("%s.tmp.%d.%p", path.c_str(), (int) getpid(), (const void *) &s);
    {
        std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
        if (!f || !f.write(out.data(), (std::streamsize) out.size()) || !f.flush()) {
            err = format("%s: cannot write the warm-start sidecar", tmp.c_str());
            std::remove(tmp.c_str());
            return false;
        }
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        err = format("%s: cannot rename over %s: %s", tmp.c_str(), path.c_str(), strerror(errno));
        std::remove(tmp.c_str());
        return false;
    }
    return true;
}

moetier_warm::moetier_warm(std::vector<entry> entries_) :
    entries(std::move(entries_)),
    state(new std::atomic<int8_t>[entries.size()]) {
    for (size_t i = 0; i < entries.size(); ++i) {
        state[i].store(0, std::memory_order_relaxed);
    }
}

moetier_warm::~moetier_warm() {
    stop();
}

void moetier_warm::stop() {
    stopping.store(true, std::memory_order_relaxed);
    if (worker.joinable()) {
        worker.join();
    }
}

void moetier_warm::start() {
    if (!entries.empty()) {
        worker = std::thread([this] { run(); });
    }
}

bool moetier_warm::wait(int32_t i) const {
    // the reads go in layer order, so the first token waits at most for its own layer's
    int8_t st;
    while ((st = state[i].load(std::memory_order_acquire)) == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return st == 1;
}

void moetier_warm::run() {
    moetier_aligned_buffer bb;
    for (size_t i = 0; i < entries.size(); ++i) {
        moetier_error err;
        const entry & en = entries[i];
        if (stopping.load(std::memory_order_relaxed)) {
            return;  // the rest stay unfinished: the model drops their slots
        }
        const bool ok = moetier_read_expert(*en.layer, MOETIER_PRECISION_HIGH, en.expert, en.slot, bb, err);
        if (!ok && !err.msg.empty()) {
            MOETIER_LOG_WARN("moetier: warm start: %s\n", err.msg.c_str());
        }
        n_read_.fetch_add(ok ? 1 : 0, std::memory_order_relaxed);
        state[i].store(ok ? 1 : 2, std::memory_order_release);
    }
}

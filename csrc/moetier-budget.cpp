#include "moetier-budget.h"

#include "moetier-impl.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

// cgroup files hold "max" (v2) or a page-rounded huge number (v1) when there is no limit
static constexpr uint64_t MOETIER_NO_LIMIT = (uint64_t) 1 << 60;

static bool moetier_read_number(const std::string & path, uint64_t & out) {
    std::ifstream f(path);
    std::string   word;
    if (!f || !(f >> word) || word.empty() || word == "max") {
        return false;
    }
    char *                   end = nullptr;
    const unsigned long long v   = strtoull(word.c_str(), &end, 10);
    if (end == nullptr || *end != '\0') {
        return false;
    }
    out = (uint64_t) v;
    return out < MOETIER_NO_LIMIT;
}

static bool moetier_is_dir(const std::string & path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// the lowest limit in file name of dir base + path and its ancestors up to base
static void moetier_cgroup_walk(const std::string & base,
                                std::string         path,
                                const char *        name,
                                const char *        kind,
                                moetier_memory &    mem) {
    if (!moetier_is_dir(base + path)) {
        path = "/";  // a cgroup namespace: this process's cgroup is the mount's root
    }
    for (;;) {
        const std::string file = base + (path == "/" ? "" : path) + "/" + name;
        uint64_t          v    = 0;
        if (moetier_read_number(file, v) && (mem.cgroup_limit == 0 || v < mem.cgroup_limit)) {
            mem.cgroup_limit  = v;
            mem.cgroup_source = format("%s %s", kind, file.c_str());
            mem.cgroup_dir    = file.substr(0, file.find_last_of('/'));
            mem.cgroup_v2     = std::string(kind) == "cgroup v2";
        }
        if (path == "/" || path.empty()) {
            break;
        }
        const size_t slash = path.find_last_of('/');
        path               = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
}

moetier_memory moetier_memory_read(const std::string & root_) {
    const std::string root = root_ == "/" ? "" : root_;
    moetier_memory    mem;
    std::ifstream     cg(root + "/proc/self/cgroup");
    std::string       line;
    while (std::getline(cg, line)) {
        // hierarchy-ID:controller-list:path
        const size_t a = line.find(':');
        const size_t b = a == std::string::npos ? std::string::npos : line.find(':', a + 1);
        if (b == std::string::npos) {
            continue;
        }
        const std::string id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1),
                          path = line.substr(b + 1);
        if (id == "0" && controllers.empty()) {
            moetier_cgroup_walk(root + "/sys/fs/cgroup", path, "memory.max", "cgroup v2", mem);
        } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
            moetier_cgroup_walk(root + "/sys/fs/cgroup/memory", path, "memory.limit_in_bytes", "cgroup v1", mem);
        }
    }
    std::ifstream meminfo(root + "/proc/meminfo");
    while (std::getline(meminfo, line)) {
        std::istringstream ss(line);
        std::string        key;
        uint64_t           kb = 0;
        if ((ss >> key >> kb) && key == "MemAvailable:") {
            mem.available = kb * 1024;
        } else if (key == "MemTotal:") {
            mem.total = kb * 1024;
        }
    }
    return mem;
}

uint64_t moetier_process_anon_bytes(const std::string & root_) {
    const std::string root = root_ == "/" ? "" : root_;
    std::ifstream     f(root + "/proc/self/status");
    std::string       line;
    while (std::getline(f, line)) {
        std::istringstream ss(line);
        std::string        key;
        uint64_t           kb = 0;
        if ((ss >> key >> kb) && key == "RssAnon:") {
            return kb * 1024;
        }
    }
    return 0;
}

uint64_t moetier_budget_auto(const moetier_memory &       mem,
                             const moetier_budget_needs & needs,
                             uint64_t                     all_experts,
                             std::string &                note,
                             uint64_t *                   room) {
    // usable memory: a cgroup limit counts the process's own anonymous memory (page cache is
    // reclaimable); MemAvailable already leaves it out
    uint64_t    usable = 0;
    std::string from;
    if (mem.cgroup_limit > 0) {
        usable = mem.cgroup_limit > needs.process ? mem.cgroup_limit - needs.process : 0;
        from   = format("%s %s - process %s", mem.cgroup_source.c_str(), moetier_format_bytes(mem.cgroup_limit).c_str(),
                        moetier_format_bytes(needs.process).c_str());
    }
    if (mem.available > 0 && (mem.cgroup_limit == 0 || mem.available < usable)) {
        usable = mem.available;
        from   = format("MemAvailable %s", moetier_format_bytes(mem.available).c_str());
    }
    // the margin covers the page cache nobody counts (the interpreter's and the libraries' code,
    // ~50 MiB for the Python API) and the estimates' error
    const uint64_t margin = std::max<uint64_t>((uint64_t) 64 << 20, usable / 32);
    const uint64_t needed = needs.weights + needs.kv + needs.compute + needs.io + needs.reserve + margin;
    if (room != nullptr) {
        *room = usable + margin > needed ? usable + margin - needed : 0;
    }
    const uint64_t left   = usable > needed ? usable - needed : 0;
    const uint64_t budget = std::min(left, all_experts);
    note = format("expert cache auto: %s = %s - non-expert weights %s - KV cache %s (n_ctx %d) - compute buffers %s",
                  moetier_format_bytes(budget).c_str(), from.c_str(), moetier_format_bytes(needs.weights).c_str(),
                  moetier_format_bytes(needs.kv).c_str(), needs.n_ctx, moetier_format_bytes(needs.compute).c_str());
    if (needs.io > 0) {
        note += format(" - read staging %s", moetier_format_bytes(needs.io).c_str());
    }
    if (needs.reserve > 0) {
        note += format(" - reserve %s", moetier_format_bytes(needs.reserve).c_str());
    }
    note += format(" - margin %s", moetier_format_bytes(margin).c_str());
    if (budget < left) {
        note +=
            format(" (capped at all experts, %s: the cache never evicts)", moetier_format_bytes(all_experts).c_str());
    }
    if (mem.cgroup_limit == 0 && mem.available == 0) {
        note = "expert cache auto: no memory limit could be read (no cgroup limit, no MemAvailable)";
    }
    return budget;
}

// the value of key in a "key value" file (memory.stat, /proc/meminfo), times scale
static bool moetier_read_key(const std::string & path, const char * name, uint64_t scale, uint64_t & out) {
    std::ifstream f(path);
    std::string   key;
    uint64_t      v = 0;
    while (f >> key >> v) {
        if (key == name) {
            out = v * scale;
            return true;
        }
        f.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
    }
    return false;
}

bool moetier_memory_headroom(const std::string & root_, const moetier_memory & mem, uint64_t & out) {
    const std::string root  = root_ == "/" ? "" : root_;
    bool              found = false;
    uint64_t          room  = UINT64_MAX;
    if (mem.cgroup_limit > 0 && !mem.cgroup_dir.empty()) {
        uint64_t usage = 0;
        if (moetier_read_number(mem.cgroup_dir + (mem.cgroup_v2 ? "/memory.current" : "/memory.usage_in_bytes"),
                                usage)) {
            uint64_t          inactive = 0;
            const std::string stat     = mem.cgroup_dir + "/memory.stat";
            // v1: the hierarchical count (the group's children too); v2 counts them in inactive_file
            const bool hierarchical    = !mem.cgroup_v2 && moetier_read_key(stat, "total_inactive_file", 1, inactive);
            if (!hierarchical) {
                moetier_read_key(stat, "inactive_file", 1, inactive);
            }
            const uint64_t used = usage > inactive ? usage - inactive : 0;
            room                = mem.cgroup_limit > used ? mem.cgroup_limit - used : 0;
            found               = true;
        }
    }
    uint64_t avail = 0;
    if (moetier_read_key(root + "/proc/meminfo", "MemAvailable:", 1024, avail)) {
        room  = std::min(room, avail);
        found = true;
    }
    out = found ? room : 0;
    return found;
}

int64_t moetier_elastic_delta(uint64_t headroom, uint64_t uncommitted, uint64_t margin) {
    const int64_t free = (int64_t) headroom - (int64_t) uncommitted;
    const int64_t m    = (int64_t) margin;
    if (free > 2 * m || free < m) {
        return free - m - m / 2;
    }
    return 0;
}

uint64_t moetier_elastic_margin(const moetier_memory & mem, uint64_t reserve) {
    uint64_t of = mem.total;
    if (mem.cgroup_limit > 0 && (of == 0 || mem.cgroup_limit < of)) {
        of = mem.cgroup_limit;
    }
    // smaller than the auto budget's floor: the free memory counts inactive page cache, which the
    // kernel reclaims before it runs short, and the cache gives back at its next layer pass
    return std::max<uint64_t>((uint64_t) 16 << 20, of / 32) + reserve;
}

std::shared_ptr<moetier_elastic> moetier_elastic::shared() {
    static std::mutex                     mu;
    static std::weak_ptr<moetier_elastic> one;
    std::lock_guard<std::mutex>           lock(mu);
    std::shared_ptr<moetier_elastic>      e = one.lock();
    if (!e) {
        e   = std::make_shared<moetier_elastic>();
        one = e;
    }
    return e;
}

moetier_elastic::moetier_elastic(std::string root_, int64_t interval) : root(std::move(root_)), interval_us(interval) {}

int32_t moetier_elastic::add_pool(uint64_t capacity_bytes, uint64_t reserve) {
    std::lock_guard<std::mutex> lock(mu);
    pools.push_back({ capacity_bytes, reserve, 0, 0, true });
    return (int32_t) pools.size() - 1;
}

void moetier_elastic::remove_pool(int32_t i) {
    std::lock_guard<std::mutex> lock(mu);
    pools[i] = pool{};
}

int64_t moetier_elastic::poll(int32_t i, uint64_t uncommitted, int64_t now_us) {
    std::lock_guard<std::mutex> lock(mu);
    pools[i].uncommitted = uncommitted;
    if (now_us >= next_us) {
        next_us                              = now_us + interval_us;
        // read afresh: the limit may have changed since the load
        const moetier_memory mem             = moetier_memory_read(root);
        uint64_t             reserve         = 0;
        uint64_t             uncommitted_all = 0;
        uint64_t             capacity        = 0;
        for (const pool & p : pools) {
            reserve += p.reserve;
            uncommitted_all += p.uncommitted;
            capacity += p.capacity;
        }
        // the reserves count as memory already promised, as the slots not yet written do
        const uint64_t margin = moetier_elastic_margin(mem, 0);
        uint64_t       room   = 0;
        margin_.store(margin + reserve, std::memory_order_relaxed);
        if (moetier_memory_headroom(root, mem, room)) {
            headroom.store(room, std::memory_order_relaxed);
            const int64_t delta = moetier_elastic_delta(room, uncommitted_all + reserve, margin);
            for (pool & p : pools) {
                // each pool in proportion to what it may hold
                p.pending = capacity > 0 ? (int64_t) ((double) delta * (double) p.capacity / (double) capacity) : 0;
            }
        }
    }
    const int64_t d  = pools[i].pending;
    pools[i].pending = 0;
    return d;
}

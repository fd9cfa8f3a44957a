#include "moetier-store.h"

#include "gguf.h"
#include "moetier-crc32c.h"
#include "moetier-impl.h"
#include "moetier-io.h"
#include "moetier.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>

using json = nlohmann::ordered_json;

#ifndef RENAME_EXCHANGE
#    define RENAME_EXCHANGE (1 << 1)  // linux/fs.h: renameat2 swaps the two paths
#endif

//
// helpers
//

namespace {

// bytes of a damaged file quoted in a message (a JSON parser's "last read: ..."), as ASCII: bytes
// outside printable ASCII become \xNN, so no message carries invalid UTF-8 onward
std::string printable(const std::string & s) {
    std::string out;
    for (const unsigned char c : s) {
        if (c >= 0x20 && c < 0x7f) {
            out += (char) c;
        } else {
            char buf[8];
            snprintf(buf, sizeof(buf), "\\x%02x", c);
            out += buf;
        }
    }
    return out;
}

// far above any model's (llama.cpp's LLAMA_MAX_EXPERTS is 512): a bound before vectors are sized by it
constexpr int32_t max_experts = 1 << 16;

// a non-negative integer field (nlohmann would wrap a negative one into a huge uint64_t)
uint64_t get_unsigned(const json & v, const char * what) {
    if (!v.is_number_unsigned()) {
        throw std::runtime_error(format("%s: %s is not a non-negative integer", what, v.dump().c_str()));
    }
    return v.get<uint64_t>();
}

}  // namespace

const char * moetier_store_checksum_name(moetier_store_checksum kind) {
    return kind == MOETIER_STORE_CHECKSUM_FNV64 ? "fnv64" : "crc32c";
}

uint64_t moetier_store_checksum_of(moetier_store_checksum kind, const void * data, size_t n) {
    return kind == MOETIER_STORE_CHECKSUM_FNV64 ? moetier_checksum(data, n) : moetier_crc32c(0, data, n);
}

std::string moetier_expert_tensor_proj(const std::string & name, int32_t * layer) {
    int il = -1;
    int n  = 0;
    if (sscanf(name.c_str(), "blk.%d.%n", &il, &n) != 1 || n <= 0) {
        return "";
    }
    static const char * const projs[] = { "gate_up", "gate", "up", "down" };
    const std::string         rest    = name.substr(n);
    for (const char * p : projs) {
        if (rest == std::string("ffn_") + p + "_exps.weight") {
            *layer = il;
            return p;
        }
    }
    return "";
}

static ggml_type moetier_type_from_name(const std::string & name) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * tn = ggml_type_name((ggml_type) t);
        if (tn && name == tn && ggml_get_type_traits((ggml_type) t)->blck_size > 0) {
            return (ggml_type) t;
        }
    }
    return GGML_TYPE_COUNT;
}

static std::string hex64(uint64_t v) {
    return format("%016" PRIx64, v);
}

static uint64_t parse_hex64(const std::string & s, const std::string & what) {
    if (s.size() != 16 || s.find_first_not_of("0123456789abcdef") != std::string::npos) {
        throw std::runtime_error(format("%s is not a 16-digit hex checksum", what.c_str()));
    }
    return strtoull(s.c_str(), nullptr, 16);
}

struct gguf_deleter {
    void operator()(gguf_context * c) const { gguf_free(c); }
};

struct ggml_ctx_deleter {
    void operator()(ggml_context * c) const { ggml_free(c); }
};

using gguf_ptr      = std::unique_ptr<gguf_context, gguf_deleter>;
using ggml_ctx_ptr_ = std::unique_ptr<ggml_context, ggml_ctx_deleter>;

// a GGUF's metadata, with tensor shapes, without its data
struct moetier_gguf_meta {
    gguf_ptr      gguf;
    ggml_ctx_ptr_ ctx;

    explicit moetier_gguf_meta(const std::string & path) {
        ggml_context *   c  = nullptr;
        gguf_init_params ip = { /*.no_alloc =*/true, /*.ctx =*/&c };
        gguf.reset(gguf_init_from_file(path.c_str(), ip));
        ctx.reset(c);
        if (!gguf) {
            throw std::runtime_error(format("%s: not a readable GGUF file", path.c_str()));
        }
    }
};

// a GGUF's served expert tensors, in file order, with where their data starts in the file
struct moetier_expert_tensor {
    const ggml_tensor * t;
    size_t              offset;
};

static std::vector<moetier_expert_tensor> moetier_expert_tensors(const moetier_gguf_meta & meta) {
    std::vector<moetier_expert_tensor> out;
    const size_t                       data_off = gguf_get_data_offset(meta.gguf.get());
    const int64_t                      n        = gguf_get_n_tensors(meta.gguf.get());
    for (int64_t i = 0; i < n; ++i) {
        int32_t      il   = -1;
        const char * name = gguf_get_tensor_name(meta.gguf.get(), i);
        if (!moetier_expert_tensor_proj(name, &il).empty()) {
            out.push_back(
                { ggml_get_tensor(meta.ctx.get(), name), data_off + gguf_get_tensor_offset(meta.gguf.get(), i) });
        }
    }
    return out;
}

moetier_model_identity moetier_model_identity_compute(const std::string & path) {
    moetier_gguf_meta meta(path);
    moetier_file      f(path, /*direct_io =*/false);

    moetier_model_identity id;
    id.file_size = f.size();

    const size_t           data_off = gguf_get_data_offset(meta.gguf.get());
    std::vector<uint8_t>   buf(data_off);
    moetier_aligned_buffer bounce;
    std::string            err;
    if (!f.read(buf.data(), 0, data_off, bounce, err)) {
        throw std::runtime_error(err);
    }
    id.header_checksum = moetier_checksum(buf.data(), buf.size());

    const std::vector<moetier_expert_tensor> experts = moetier_expert_tensors(meta);
    if (!experts.empty()) {
        const size_t n_sample = std::min<size_t>(experts[0].t->nb[2], 1u << 20);
        buf.resize(n_sample);
        if (!f.read(buf.data(), experts[0].offset, n_sample, bounce, err)) {
            throw std::runtime_error(err);
        }
        id.sample_checksum = moetier_checksum(buf.data(), buf.size());
    }
    return id;
}

uint64_t moetier_model_experts_sample(const std::string & path) {
    moetier_gguf_meta      meta(path);
    moetier_file           f(path, /*direct_io =*/false);
    constexpr int64_t      n_pick = 8;
    std::vector<uint8_t>   buf;
    std::vector<uint64_t>  sums;
    moetier_aligned_buffer bounce;
    std::string            err;
    for (const moetier_expert_tensor & x : moetier_expert_tensors(meta)) {
        const int64_t n_expert = x.t->ne[2];
        const size_t  n_sample = std::min<size_t>(x.t->nb[2], 4096);
        buf.resize(n_sample);
        for (int64_t k = 0; k < std::min(n_pick, n_expert); ++k) {
            const int64_t e = n_expert <= n_pick ? k : k * (n_expert - 1) / (n_pick - 1);  // first and last
            if (!f.read(buf.data(), x.offset + (size_t) e * x.t->nb[2], n_sample, bounce, err)) {
                throw std::runtime_error(err);
            }
            sums.push_back(moetier_checksum(buf.data(), buf.size()));
        }
    }
    return moetier_checksum(sums.data(), sums.size() * sizeof(uint64_t));
}

static json identity_to_json(const moetier_model_identity & id) {
    return json{
        { "file_size",       id.file_size              },
        { "header_checksum", hex64(id.header_checksum) },
        { "sample_checksum", hex64(id.sample_checksum) },
    };
}

//
// moetier_store
//

moetier_store::moetier_store(const std::string &            dir,
                             const moetier_model_identity & model,
                             const std::string &            model_path) :
    dir_(dir) {
    manifest_path_ = dir + "/manifest.json";
    data_path_     = dir + "/experts.bin";

    struct stat st;
    if (stat(dir.c_str(), &st) != 0) {
        throw std::runtime_error(
            format("%s: expert store directory does not exist; create it with `moetier pack MODEL -o %s`", dir.c_str(),
                   dir.c_str()));
    }
    if (!S_ISDIR(st.st_mode)) {
        throw std::runtime_error(
            format("%s: is a file, not an expert store; give the directory `moetier pack` wrote", dir.c_str()));
    }
    std::ifstream in(manifest_path_);
    if (!in) {
        throw std::runtime_error(format("%s: missing store manifest; the store is incomplete, re-run `moetier pack`",
                                        manifest_path_.c_str()));
    }

    json j;
    try {
        j = json::parse(in);
    } catch (const std::exception & e) {
        throw std::runtime_error(format("%s: corrupt store manifest (not valid JSON: %s); re-run `moetier pack`",
                                        manifest_path_.c_str(), printable(e.what()).c_str()));
    }

    try {
        if (j.value("format", "") != "moetier-store") {
            throw std::runtime_error("not a moetier store manifest (\"format\" is not \"moetier-store\")");
        }
        const int version = j.at("version").get<int>();
        if (version == 1) {
            checksum_ = MOETIER_STORE_CHECKSUM_FNV64;  // verified with its own hash; the model says so once
        } else if (version == MOETIER_STORE_VERSION) {
            if (j.at("checksum").get<std::string>() != "crc32c") {
                throw std::runtime_error(
                    format("checksum %s, this build reads \"crc32c\"", j.at("checksum").dump().c_str()));
            }
        } else {
            throw std::runtime_error(
                format("store version %d, this build reads versions 1 and %d; re-run `moetier pack`", version,
                       MOETIER_STORE_VERSION));
        }
        moetier_model_identity id;
        const json &           jm = j.at("model");
        id.file_size              = jm.at("file_size").get<uint64_t>();
        id.header_checksum        = parse_hex64(jm.at("header_checksum").get<std::string>(), "model.header_checksum");
        id.sample_checksum        = parse_hex64(jm.at("sample_checksum").get<std::string>(), "model.sample_checksum");
        if (!(id == model) || (jm.contains("experts_sample") &&
                               parse_hex64(jm.at("experts_sample").get<std::string>(), "model.experts_sample") !=
                                   moetier_model_experts_sample(model_path))) {
            throw std::runtime_error(format("the store was packed from a different model (%s, %" PRIu64 " bytes); "
                                            "re-run `moetier pack` on this model",
                                            jm.value("path", "?").c_str(), id.file_size));
        }
        low_type_ = moetier_type_from_name(j.at("low_type").get<std::string>());
        if (low_type_ == GGML_TYPE_COUNT) {
            throw std::runtime_error("unknown low_type");
        }
        const std::string store_id = j.at("store_id").get<std::string>();
        id_                        = store_id;
        const uint64_t data_size   = get_unsigned(j.at("data_size"), "data_size");
        // fields this build writes with one value only: another value is another layout, not ignored
        if (get_unsigned(j.at("alignment"), "alignment") != MOETIER_ALIGN) {
            throw std::runtime_error(
                format("alignment %s, this build reads %zu", j.at("alignment").dump().c_str(), MOETIER_ALIGN));
        }
        if (j.at("data_file").get<std::string>() != "experts.bin") {
            throw std::runtime_error("data_file is not \"experts.bin\"");
        }

        // every expert's byte range, to check that none overlaps another
        std::vector<std::pair<uint64_t, uint64_t>> ranges;
        for (const json & jl : j.at("layers")) {
            moetier_store_layer l;
            l.layer    = jl.at("layer").get<int32_t>();
            l.n_expert = jl.at("n_expert").get<int32_t>();
            if (l.layer < 0 || l.n_expert <= 0 || l.n_expert > max_experts) {
                throw std::runtime_error(format("layer %d: bad layer index or expert count %d", l.layer, l.n_expert));
            }
            for (const moetier_store_layer & prev : layers_) {
                if (prev.layer == l.layer) {
                    throw std::runtime_error(format("layer %d is listed twice", l.layer));
                }
            }
            for (const json & jp : jl.at("projections")) {
                moetier_store_proj p;
                p.checksum   = checksum_;
                p.name       = jp.at("name").get<std::string>();
                p.tensor     = jp.at("tensor").get<std::string>();
                p.ne0        = jp.at("ne").at(0).get<int64_t>();
                p.ne1        = jp.at("ne").at(1).get<int64_t>();
                p.type_high  = moetier_type_from_name(jp.at("type_high").get<std::string>());
                p.type_low   = moetier_type_from_name(jp.at("type_low").get<std::string>());
                p.bytes_high = get_unsigned(jp.at("bytes_high"), "bytes_high");
                p.bytes_low  = get_unsigned(jp.at("bytes_low"), "bytes_low");
                for (const json & o : jp.at("offset_high")) {
                    p.offset_high.push_back(get_unsigned(o, "offset_high"));
                }
                for (const json & o : jp.at("offset_low")) {
                    p.offset_low.push_back(get_unsigned(o, "offset_low"));
                }
                int32_t t_layer = -1;
                if (moetier_expert_tensor_proj(p.tensor, &t_layer) != p.name || t_layer != l.layer) {
                    throw std::runtime_error(format("projection %s of layer %d: tensor %s is not its expert tensor",
                                                    p.name.c_str(), l.layer, p.tensor.c_str()));
                }
                for (const auto & s : jp.at("checksum_high")) {
                    p.checksum_high.push_back(parse_hex64(s.get<std::string>(), p.tensor + " checksum_high"));
                }
                for (const auto & s : jp.at("checksum_low")) {
                    p.checksum_low.push_back(parse_hex64(s.get<std::string>(), p.tensor + " checksum_low"));
                }
                const size_t ne = (size_t) l.n_expert;
                if (p.type_high == GGML_TYPE_COUNT || p.type_low == GGML_TYPE_COUNT || p.offset_high.size() != ne ||
                    p.offset_low.size() != ne || p.checksum_high.size() != ne || p.checksum_low.size() != ne) {
                    throw std::runtime_error(
                        format("projection %s: bad types or per-expert list lengths", p.tensor.c_str()));
                }
                // one expert's bytes as its shape and type give them, in overflow-free arithmetic
                const int64_t max_ne = int64_t(1) << 24;
                if (p.ne0 <= 0 || p.ne1 <= 0 || p.ne0 > max_ne || p.ne1 > max_ne ||
                    p.ne0 % ggml_blck_size(p.type_high) || p.ne0 % ggml_blck_size(p.type_low) ||
                    p.bytes_high != ggml_row_size(p.type_high, p.ne0) * (uint64_t) p.ne1 ||
                    p.bytes_low != ggml_row_size(p.type_low, p.ne0) * (uint64_t) p.ne1) {
                    throw std::runtime_error(format("projection %s: shape [%" PRId64 ", %" PRId64
                                                    "] does not give bytes_high %" PRIu64 " / bytes_low %" PRIu64,
                                                    p.tensor.c_str(), p.ne0, p.ne1, p.bytes_high, p.bytes_low));
                }
                for (size_t e = 0; e < ne; ++e) {
                    for (const auto [off, n] : { std::make_pair(p.offset_high[e], moetier_align_up(p.bytes_high)),
                                                 std::make_pair(p.offset_low[e], moetier_align_up(p.bytes_low)) }) {
                        // off + n > data_size, written so that a huge offset cannot wrap around
                        if (off % MOETIER_ALIGN || off < MOETIER_ALIGN || off > data_size || n > data_size - off) {
                            throw std::runtime_error(format("projection %s expert %zu: offset %" PRIu64
                                                            " unaligned or its %" PRIu64
                                                            " bytes outside the data (%" PRIu64 " bytes)",
                                                            p.tensor.c_str(), e, off, n, data_size));
                        }
                        ranges.emplace_back(off, off + n);
                    }
                }
                l.projs.push_back(std::move(p));
            }
            layers_.push_back(std::move(l));
        }

        std::sort(ranges.begin(), ranges.end());
        for (size_t i = 1; i < ranges.size(); ++i) {
            if (ranges[i].first < ranges[i - 1].second) {
                throw std::runtime_error(
                    format("two experts' byte ranges overlap at offset %" PRIu64, ranges[i].first));
            }
        }

        // experts.bin must be the one this manifest was written with, and complete
        moetier_file f(data_path_, /*direct_io =*/false);
        if (f.size() != data_size) {
            throw std::runtime_error(format("%s: expert data is truncated or altered: %" PRIu64
                                            " bytes, manifest says %" PRIu64 "; re-run `moetier pack`",
                                            data_path_.c_str(), f.size(), data_size));
        }
        char                   head[64] = {};
        moetier_aligned_buffer bounce;
        std::string            err;
        if (!f.read(head, 0, sizeof(head), bounce, err)) {
            throw std::runtime_error(err);
        }
        const std::string want = std::string(MOETIER_STORE_MAGIC) + store_id;
        if (memcmp(head, want.data(), std::min(want.size(), sizeof(head))) != 0) {
            throw std::runtime_error(format(
                "%s: does not belong to this manifest (store id mismatch); re-run `moetier pack`", data_path_.c_str()));
        }
    } catch (const json::exception & e) {
        throw std::runtime_error(
            format("%s: corrupt store manifest (%s); re-run `moetier pack`", manifest_path_.c_str(), e.what()));
    } catch (const std::runtime_error & e) {
        const std::string msg = e.what();
        if (msg.rfind(dir_, 0) == 0) {
            throw;
        }
        throw std::runtime_error(manifest_path_ + ": " + msg);
    }
}

const moetier_store_proj * moetier_store::find(int32_t layer, const std::string & proj) const {
    for (const auto & l : layers_) {
        if (l.layer != layer) {
            continue;
        }
        for (const auto & p : l.projs) {
            if (p.name == proj) {
                return &p;
            }
        }
    }
    return nullptr;
}

//
// pack
//

// RAII output file: written under a temporary name, renamed into place only by commit()
class moetier_out_file {
  public:
    moetier_out_file(const std::string & path) : path_(path), tmp_(path + ".tmp") {
        fd_ = open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd_ < 0) {
            throw std::runtime_error(format("%s: cannot create: %s", tmp_.c_str(), strerror(errno)));
        }
    }

    ~moetier_out_file() {
        if (fd_ >= 0) {
            close(fd_);
            unlink(tmp_.c_str());
        }
    }

    void write_at(const void * data, size_t n, uint64_t offset) {
        const uint8_t * p    = (const uint8_t *) data;
        size_t          done = 0;
        while (done < n) {
            const ssize_t r = pwrite(fd_, p + done, n - done, (off_t) (offset + done));
            if (r < 0) {
                if (errno == EINTR) {
                    continue;
                }
                throw std::runtime_error(format("%s: write failed: %s", tmp_.c_str(), strerror(errno)));
            }
            done += (size_t) r;
        }
    }

    void truncate(uint64_t size) {
        if (ftruncate(fd_, (off_t) size) != 0) {
            throw std::runtime_error(format("%s: ftruncate failed: %s", tmp_.c_str(), strerror(errno)));
        }
    }

    void commit() {
        if (fsync(fd_) != 0) {
            throw std::runtime_error(format("%s: fsync failed: %s", tmp_.c_str(), strerror(errno)));
        }
        close(fd_);
        fd_ = -1;
        if (rename(tmp_.c_str(), path_.c_str()) != 0) {
            const int e = errno;
            unlink(tmp_.c_str());
            throw std::runtime_error(format("%s: rename failed: %s", path_.c_str(), strerror(e)));
        }
    }
  private:
    std::string path_;
    std::string tmp_;
    int         fd_ = -1;
};

static void fsync_dir(const std::string & dir) {
    const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

struct moetier_pack_cancelled {};

// what a store directory may hold: its two files, the warm start's sidecar (moetier-model.cpp; it
// describes this store, so it goes with it) and their temporaries
static bool is_store_file(const std::string & name) {
    const auto ends_with = [&](const char * suf) {
        const size_t n = strlen(suf);
        return name.size() >= n && name.compare(name.size() - n, n, suf) == 0;
    };
    return name == "manifest.json" || name == "experts.bin" || name == "cache-state.bin" || ends_with(".tmp");
}

// the entries of dir (none if it does not exist); throws if dir is something else than a store
// directory: a store is published by swapping whole directories, so the directory is the store's
static std::vector<std::string> store_dir_entries(const std::string & dir) {
    std::vector<std::string> names;
    DIR *                    d = opendir(dir.c_str());
    if (!d) {
        if (errno == ENOENT) {
            return names;
        }
        if (errno == ENOTDIR) {
            throw std::runtime_error(
                format("%s: is a file, not a directory; pack into an empty or new directory of its own", dir.c_str()));
        }
        throw std::runtime_error(format("%s: cannot open directory: %s", dir.c_str(), strerror(errno)));
    }
    for (dirent * e = readdir(d); e; e = readdir(d)) {
        const std::string n = e->d_name;
        if (n != "." && n != "..") {
            names.push_back(n);
        }
    }
    closedir(d);
    for (const std::string & n : names) {
        if (!is_store_file(n)) {
            throw std::runtime_error(
                format("%s: holds %s, so it is not a store directory; pack into an empty or "
                       "new directory of its own",
                       dir.c_str(), n.c_str()));
        }
    }
    return names;
}

static void remove_store_dir(const std::string & dir) {
    for (const std::string & n : store_dir_entries(dir)) {
        unlink((dir + "/" + n).c_str());
    }
    rmdir(dir.c_str());
}

// the pack's working directory, a sibling of the store's, removed unless publish() took it
class moetier_pack_dir {
  public:
    explicit moetier_pack_dir(const std::string & out_dir) {
        final_ = out_dir;
        while (final_.size() > 1 && final_.back() == '/') {
            final_.pop_back();
        }
        work_ = final_ + ".pack-tmp";
        store_dir_entries(final_);  // refuse a directory that holds more than a store, before any work
        remove_store_dir(work_);    // left by a pack that was killed
        if (mkdir(work_.c_str(), 0755) != 0) {
            throw std::runtime_error(format("%s: cannot create directory: %s", work_.c_str(), strerror(errno)));
        }
    }

    ~moetier_pack_dir() {
        try {
            remove_store_dir(work_);
        } catch (const std::exception &) {
            // something else was put there meanwhile: leave it
        }
    }

    const std::string & path() const { return work_; }

    // the complete new store replaces the old one in one step: a kill at any point leaves the old
    // store or the new one in out_dir, never a mix and never neither
    void publish() {
        fsync_dir(work_);
        struct stat st;
        if (stat(final_.c_str(), &st) != 0) {
            if (rename(work_.c_str(), final_.c_str()) != 0) {
                throw std::runtime_error(format("%s: rename failed: %s", final_.c_str(), strerror(errno)));
            }
        } else if (syscall(SYS_renameat2, AT_FDCWD, work_.c_str(), AT_FDCWD, final_.c_str(), RENAME_EXCHANGE) != 0) {
            if (errno != EINVAL && errno != ENOSYS) {
                throw std::runtime_error(format("%s: rename failed: %s", final_.c_str(), strerror(errno)));
            }
            // no atomic exchange on this filesystem: the manifest is the commit point, removed first
            // so that an old manifest never stands next to new data (a kill here leaves no store)
            unlink((final_ + "/manifest.json").c_str());
            for (const char * f : { "experts.bin", "manifest.json" }) {
                if (rename((work_ + "/" + f).c_str(), (final_ + "/" + f).c_str()) != 0) {
                    throw std::runtime_error(format("%s/%s: rename failed: %s", final_.c_str(), f, strerror(errno)));
                }
            }
        }
        const size_t slash = final_.rfind('/');
        fsync_dir(slash == std::string::npos ? "." : slash == 0 ? "/" : final_.substr(0, slash));
    }
  private:
    std::string final_;
    std::string work_;
};

static void moetier_pack_impl(const std::string &         model_path,
                              const std::string &         out_dir,
                              const moetier_pack_params & params) {
    // low_type is one ggml type, or a list "q2_K,q4_0": each projection takes the first type whose
    // block size divides its rows (K-quants pack 256 values, and an expert's FFN width need not be a
    // multiple of 256: moefy's 224-wide experts, Qwen1.5-MoE's 1408). "auto": q4_0, except for
    // experts of 5 bits per weight or fewer (a Q4_K model), whose q4_0 copy would be as large as the
    // experts themselves (a store of twice the model for nothing): q2_K where the rows allow, else q4_0
    std::string low_spec = params.low_type ? params.low_type : "";
    const bool  low_auto = low_spec == "auto";
    if (low_auto) {
        low_spec = "q2_K,q4_0";
    }
    std::vector<ggml_type> low_types;
    for (size_t start = 0;;) {
        const size_t      comma = low_spec.find(',', start);
        const std::string name = low_spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        const ggml_type   lt   = moetier_type_from_name(name);
        if (lt == GGML_TYPE_COUNT) {
            throw std::runtime_error(
                format("unknown low-precision type '%s'; use a ggml type name such as q4_0, q8_0, f16, or a list such "
                       "as q2_K,q4_0",
                       name.c_str()));
        }
        if (ggml_quantize_requires_imatrix(lt)) {
            throw std::runtime_error(format(
                "low-precision type %s needs an importance matrix; choose e.g. q4_0 or q4_k", ggml_type_name(lt)));
        }
        if (ggml_get_type_traits(lt)->from_float_ref == nullptr && lt != GGML_TYPE_F32) {
            throw std::runtime_error(format("low-precision type %s cannot be quantized to", ggml_type_name(lt)));
        }
        low_types.push_back(lt);
        if (comma == std::string::npos) {
            break;
        }
        start = comma + 1;
    }

    moetier_gguf_meta            meta(model_path);
    const moetier_model_identity id = moetier_model_identity_compute(model_path);
    moetier_file                 src(model_path, /*direct_io =*/false);
    const size_t                 data_off = gguf_get_data_offset(meta.gguf.get());

    // collect the served projections, grouped by layer
    struct src_proj {
        std::string         name;
        std::string         tensor;
        const ggml_tensor * t;
        uint64_t            offset;  // of expert 0 in the GGUF
        ggml_type           low;     // type of its low-precision copy
    };

    std::map<int32_t, std::vector<src_proj>> layers;
    const int64_t                            n_tensors = gguf_get_n_tensors(meta.gguf.get());
    for (int64_t i = 0; i < n_tensors; ++i) {
        const char *      name = gguf_get_tensor_name(meta.gguf.get(), i);
        int32_t           il   = -1;
        const std::string proj = moetier_expert_tensor_proj(name, &il);
        if (proj.empty()) {
            continue;
        }
        const ggml_tensor * t = ggml_get_tensor(meta.ctx.get(), name);
        if (ggml_n_dims(t) != 3) {
            throw std::runtime_error(format("%s: tensor %s is not 3-D", model_path.c_str(), name));
        }
        ggml_type    low      = GGML_TYPE_COUNT;
        // auto: q2_K only below the experts' own size; bits per weight of the high type
        const double high_bpw = 8.0 * (double) ggml_type_size(t->type) / (double) ggml_blck_size(t->type);
        for (const ggml_type lt : low_types) {
            if (low_auto && lt == GGML_TYPE_Q2_K && high_bpw > 5.0) {
                continue;
            }
            if (t->ne[0] % ggml_blck_size(lt) == 0) {
                low = lt;
                break;
            }
        }
        if (low == GGML_TYPE_COUNT) {
            std::string blocks;
            for (const ggml_type lt : low_types) {
                blocks += format("%s%s block size %" PRId64, blocks.empty() ? "the " : ", nor of the ",
                                 ggml_type_name(lt), ggml_blck_size(lt));
            }
            throw std::runtime_error(
                format("%s: tensor %s rows of %" PRId64 " values are not a multiple of %s%s", model_path.c_str(), name,
                       t->ne[0], blocks.c_str(),
                       low_types.size() == 1 ? "; give a fallback type, e.g. --low-type q2_K,q4_0" : ""));
        }
        layers[il].push_back({ proj, name, t, data_off + gguf_get_tensor_offset(meta.gguf.get(), i), low });
    }
    if (layers.empty()) {
        throw std::runtime_error(
            format("%s: no expert tensors (blk.N.ffn_*_exps.weight): not a MoE model", model_path.c_str()));
    }
    // the manifest's store-wide name (each projection records its own)
    const ggml_type low_type = layers.begin()->second.front().low;

    // layout: header block, then per layer, per expert: high projections, then low projections
    std::mt19937_64   rng(std::random_device{}() ^ (uint64_t) moetier_time_us());
    const std::string store_id = hex64(rng()) + hex64(rng());

    uint64_t total_high = 0;
    uint64_t pos        = MOETIER_ALIGN;
    json     jlayers    = json::array();

    struct job {
        const src_proj * sp;
        int32_t          expert;
        uint64_t         off_high;
        uint64_t         off_low;
        json *           jp;
    };

    std::vector<job>                     jobs;
    std::map<int32_t, std::vector<json>> jprojs;

    for (auto & [il, projs] : layers) {
        const int32_t n_expert = (int32_t) projs[0].t->ne[2];
        for (const auto & sp : projs) {
            if (sp.t->ne[2] != n_expert) {
                throw std::runtime_error(
                    format("%s: layer %d expert tensors disagree on the number of experts", model_path.c_str(), il));
            }
            const uint64_t bytes_high = sp.t->nb[2];
            const uint64_t bytes_low  = ggml_row_size(sp.low, sp.t->ne[0]) * sp.t->ne[1];
            json           jp         = {
                { "name",          sp.name                      },
                { "tensor",        sp.tensor                    },
                { "ne",            { sp.t->ne[0], sp.t->ne[1] } },
                { "type_high",     ggml_type_name(sp.t->type)   },
                { "bytes_high",    bytes_high                   },
                { "type_low",      ggml_type_name(sp.low)       },
                { "bytes_low",     bytes_low                    },
                { "offset_high",   json::array()                },
                { "offset_low",    json::array()                },
                { "checksum_high", json::array()                },
                { "checksum_low",  json::array()                },
            };
            jprojs[il].push_back(std::move(jp));
            total_high += bytes_high * n_expert;
        }
        for (int32_t e = 0; e < n_expert; ++e) {
            for (size_t k = 0; k < projs.size(); ++k) {
                jobs.push_back({ &projs[k], e, pos, 0, nullptr });
                pos += moetier_align_up(projs[k].t->nb[2]);
            }
            for (size_t k = 0; k < projs.size(); ++k) {
                job & jb   = jobs[jobs.size() - projs.size() + k];
                jb.off_low = pos;
                pos += moetier_align_up(ggml_row_size(projs[k].low, projs[k].t->ne[0]) * projs[k].t->ne[1]);
            }
        }
    }
    const uint64_t data_size = pos;

    // written whole into a sibling directory, then swapped in (moetier_pack_dir::publish)
    moetier_pack_dir  dir(out_dir);
    const std::string manifest_path = dir.path() + "/manifest.json";

    moetier_out_file out(dir.path() + "/experts.bin");
    {
        std::vector<uint8_t> head(MOETIER_ALIGN, 0);
        const std::string    h = std::string(MOETIER_STORE_MAGIC) + store_id;
        memcpy(head.data(), h.data(), h.size());
        out.write_at(head.data(), head.size(), 0);
    }

    moetier_aligned_buffer bounce;
    std::vector<uint8_t>   high, low;
    std::vector<float>     f32;
    std::string            err;
    uint64_t               done = 0;
    for (const job & jb : jobs) {
        const ggml_tensor * t          = jb.sp->t;
        const uint64_t      bytes_high = t->nb[2];
        const int64_t       n_per_row  = t->ne[0];
        const int64_t       n_rows     = t->ne[1];
        const ggml_type     proj_low   = jb.sp->low;
        const uint64_t      bytes_low  = ggml_row_size(proj_low, n_per_row) * n_rows;

        high.assign(moetier_align_up(bytes_high), 0);
        if (!src.read(high.data(), jb.sp->offset + (uint64_t) jb.expert * bytes_high, bytes_high, bounce, err)) {
            throw std::runtime_error(err);
        }
        low.assign(moetier_align_up(bytes_low), 0);
        if (proj_low == t->type) {
            memcpy(low.data(), high.data(), bytes_high);
        } else {
            f32.resize((size_t) (n_per_row * n_rows));
            const auto * tr = ggml_get_type_traits(t->type);
            if (t->type == GGML_TYPE_F32) {
                memcpy(f32.data(), high.data(), bytes_high);
            } else if (tr->to_float) {
                tr->to_float(high.data(), f32.data(), n_per_row * n_rows);
            } else {
                throw std::runtime_error(format("%s: tensor %s of type %s cannot be dequantized", model_path.c_str(),
                                                t->name, ggml_type_name(t->type)));
            }
            ggml_quantize_chunk(proj_low, f32.data(), low.data(), 0, n_rows, n_per_row, nullptr);
        }
        out.write_at(high.data(), high.size(), jb.off_high);
        out.write_at(low.data(), low.size(), jb.off_low);

        json *  jp = nullptr;
        int32_t il = -1;
        moetier_expert_tensor_proj(t->name, &il);
        for (auto & p : jprojs[il]) {
            if (p["name"] == jb.sp->name) {
                jp = &p;
            }
        }
        (*jp)["offset_high"].push_back(jb.off_high);
        (*jp)["offset_low"].push_back(jb.off_low);
        (*jp)["checksum_high"].push_back(hex64(moetier_crc32c(0, high.data(), bytes_high)));
        (*jp)["checksum_low"].push_back(hex64(moetier_crc32c(0, low.data(), bytes_low)));

        done += bytes_high;
        if (params.progress_callback &&
            !params.progress_callback(done, total_high, params.progress_callback_user_data)) {
            throw moetier_pack_cancelled();
        }
    }
    out.truncate(data_size);
    out.commit();

    for (auto & [il, projs] : layers) {
        jlayers.push_back({
            { "layer",       il                },
            { "n_expert",    projs[0].t->ne[2] },
            { "projections", jprojs[il]        }
        });
    }
    json jm              = identity_to_json(id);
    jm["experts_sample"] = hex64(moetier_model_experts_sample(model_path));
    jm["path"]           = model_path;
    const json manifest  = {
        { "format",    "moetier-store"          },
        { "version",   MOETIER_STORE_VERSION    },
        { "checksum",  "crc32c"                 },
        { "store_id",  store_id                 },
        { "model",     jm                       },
        { "low_type",  ggml_type_name(low_type) },
        { "alignment", MOETIER_ALIGN            },
        { "data_file", "experts.bin"            },
        { "data_size", data_size                },
        { "layers",    jlayers                  },
    };
    moetier_out_file  mf(manifest_path);
    const std::string text = manifest.dump(1) + "\n";
    mf.write_at(text.data(), text.size(), 0);
    mf.commit();
    dir.publish();
}

struct moetier_pack_params moetier_pack_default_params(void) {
    moetier_pack_params p = {
        /*.low_type                    =*/"auto",
        /*.progress_callback           =*/nullptr,
        /*.progress_callback_user_data =*/nullptr,
    };
    return p;
}

int32_t moetier_pack(const char * model_path, const char * out_dir, struct moetier_pack_params params) {
    moetier_set_last_error(MOETIER_ERROR_NONE, "");
    try {
        moetier_pack_impl(model_path, out_dir, params);
        return 0;
    } catch (const moetier_pack_cancelled &) {
        moetier_set_last_error(MOETIER_ERROR_STORE, "cancelled");
        return -2;
    } catch (const std::exception & e) {
        // whatever went wrong, no store was written: a store error
        MOETIER_LOG_ERROR("%s: %s\n", __func__, e.what());
        moetier_set_last_error(MOETIER_ERROR_STORE, e.what());
        return -1;
    }
}

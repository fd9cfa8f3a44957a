#pragma once

// The on-disk expert store written by `moetier pack`:
//
//   DIR/manifest.json  format, version, store id, model identity, and per served projection its
//                      types, shapes, and each expert's offsets and checksums
//   DIR/experts.bin    a 4096-byte header (magic + store id), then for each layer and expert its
//                      projections in the model's precision, then in the low precision, each at a
//                      4096-aligned offset and zero-padded to 4096, so reads are O_DIRECT straight
//                      into cache slots
//
// Knows nothing of ggml graphs or the cache.

#include "ggml.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#define MOETIER_STORE_MAGIC   "MOETIER-STORE\n"
// 2: expert checksums are CRC32C ("checksum": "crc32c"); 1: the older 64-bit hash (moetier_checksum),
// still read and verified with it, with a warning that re-packing makes the check cheaper
#define MOETIER_STORE_VERSION 2

// the checksum of an expert's bytes a store holds
enum moetier_store_checksum {
    MOETIER_STORE_CHECKSUM_CRC32C = 0,  // version 2: hardware CRC32C, at memory speed
    MOETIER_STORE_CHECKSUM_FNV64  = 1,  // version 1: moetier_checksum, a few GB/s
};

// "crc32c" or "fnv64"
const char * moetier_store_checksum_name(moetier_store_checksum kind);

// the checksum of n bytes as a store of that kind holds it
uint64_t moetier_store_checksum_of(moetier_store_checksum kind, const void * data, size_t n);

// What ties a store (and a cache) to one GGUF file, cheap to compute at load: the file size, a
// checksum of everything before the tensor data (metadata + tensor infos), and a checksum of the
// first served expert's bytes, which tells apart files that differ only in weights.
struct moetier_model_identity {
    uint64_t file_size       = 0;
    uint64_t header_checksum = 0;
    uint64_t sample_checksum = 0;

    bool operator==(const moetier_model_identity & o) const {
        return file_size == o.file_size && header_checksum == o.header_checksum && sample_checksum == o.sample_checksum;
    }
};

// Experts of MoE layers are the 3-D tensors blk.N.ffn_{gate,up,down,gate_up}_exps.weight.
// Returns the projection name ("gate", "up", "down", "gate_up") and sets *layer, or "" if not one.
std::string moetier_expert_tensor_proj(const std::string & tensor_name, int32_t * layer);

// throws std::runtime_error naming the path
moetier_model_identity moetier_model_identity_compute(const std::string & gguf_path);

// A checksum over a sample of the experts of every expert tensor: the first 4 KiB of 8 experts spread
// over each tensor (the first and the last among them). It tells apart most files whose header and
// first expert agree but whose later experts differ (a variant edited in some layers, a consolidated
// variant), which the identity's one sample cannot; a sample, not every expert: at about a thousand small reads for a 30B-class model, it is checked at load against a store
// that holds it (stores packed before it existed do not). throws std::runtime_error naming the path
uint64_t moetier_model_experts_sample(const std::string & gguf_path);

struct moetier_store_proj {
    std::string            name;            // "gate", "up", "down" or "gate_up"
    std::string            tensor;          // GGUF tensor name
    int64_t                ne0        = 0;  // per-expert shape [ne0, ne1]
    int64_t                ne1        = 0;
    ggml_type              type_high  = GGML_TYPE_COUNT;
    ggml_type              type_low   = GGML_TYPE_COUNT;
    uint64_t               bytes_high = 0;  // unpadded bytes of one expert
    uint64_t               bytes_low  = 0;
    std::vector<uint64_t>  offset_high;     // [n_expert]
    std::vector<uint64_t>  offset_low;      // [n_expert]
    std::vector<uint64_t>  checksum_high;   // [n_expert] of the unpadded bytes, by `checksum`
    std::vector<uint64_t>  checksum_low;    // [n_expert]
    moetier_store_checksum checksum = MOETIER_STORE_CHECKSUM_CRC32C;

    uint64_t checksum_of(const void * data, size_t n) const { return moetier_store_checksum_of(checksum, data, n); }
};

struct moetier_store_layer {
    int32_t                         layer    = -1;
    int32_t                         n_expert = 0;
    std::vector<moetier_store_proj> projs;
};

class moetier_store {
  public:
    // Opens DIR, parses and validates the manifest against experts.bin and the model identity (and,
    // where the manifest holds it, the experts sample of the GGUF at model_path).
    // throws std::runtime_error naming the file and the problem
    moetier_store(const std::string & dir, const moetier_model_identity & model, const std::string & model_path);

    const moetier_store_proj * find(int32_t layer, const std::string & proj) const;

    const std::string & dir() const { return dir_; }

    const std::string & data_path() const { return data_path_; }

    const std::string & manifest_path() const { return manifest_path_; }

    ggml_type low_type() const { return low_type_; }

    // random id written by each pack: a re-packed store is another store
    const std::string & id() const { return id_; }

    // the checksum its experts are verified with (an older store's own hash)
    moetier_store_checksum checksum() const { return checksum_; }

  private:
    std::string                      dir_;
    std::string                      id_;
    std::string                      data_path_;
    std::string                      manifest_path_;
    ggml_type                        low_type_ = GGML_TYPE_COUNT;
    moetier_store_checksum           checksum_ = MOETIER_STORE_CHECKSUM_CRC32C;
    std::vector<moetier_store_layer> layers_;
};

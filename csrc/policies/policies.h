#pragma once

// Eviction policies of the expert cache. A policy sees slots of one pool group and the expert each
// holds; the cache tells it about hits and loads and asks it for a victim among unpinned slots.
// A new policy is one file in csrc/policies/ plus one line in moetier_policy_create.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

// which expert a slot holds
struct moetier_key {
    int32_t layer  = -1; // model layer index
    int32_t expert = -1; // expert index within the layer
};

struct moetier_policy_i {
    virtual ~moetier_policy_i() = default;

    // called once, before any other call, with the number of slots of the group
    virtual void init(int32_t n_slots) = 0;

    // slot already held key and is used again; tick increases with every layer pass of the cache
    virtual void on_hit(int32_t slot, const moetier_key & key, uint64_t tick) = 0;

    // slot was just filled with key
    virtual void on_load(int32_t slot, const moetier_key & key, uint64_t tick) = 0;

    // choose the slot to evict among those with excluded[slot] == 0 (at least one exists); the cache
    // excludes pinned slots and the slots of layers other than the one it evicts from
    virtual int32_t victim(const std::vector<uint8_t> & excluded, uint64_t tick) = 0;

    // a new sequence starts: forget sequence-level records
    virtual void reset_sequence() = 0;
};

using moetier_policy_ptr = std::unique_ptr<moetier_policy_i>;

// nullptr if name is unknown
moetier_policy_ptr moetier_policy_create(const std::string & name);

// one factory per policy file
moetier_policy_ptr moetier_policy_lru_create();

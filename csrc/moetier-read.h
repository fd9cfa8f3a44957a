#pragma once

// What an expert read moves into a slot, and its checksum: the one place that turns (layer,
// precision, expert, slot) into file ranges and slot addresses. The load op, the I/O threads, the
// io_uring and the synchronous re-read of a failed prefetch all read through here.

#include "moetier-impl.h"
#include "moetier-io.h"
#include "moetier-iopool.h"
#include "moetier-layer.h"

#include <cstdint>

// one read into a slot: one projection of an expert, or (proj = MOETIER_READ_ALL) every projection
// in one vectored read, where the layer's projections lie back to back in the file (file_order)
static constexpr int32_t MOETIER_READ_ALL = -1;

struct moetier_read {
    const moetier_layer * layer  = nullptr;
    int32_t               proj   = MOETIER_READ_ALL;
    moetier_precision     prec   = MOETIER_PRECISION_HIGH;
    int32_t               expert = 0;
    int32_t               slot   = 0;
};

// reads one expert takes: 1 when its projections are one range of the file, else one per projection
int32_t moetier_read_parts(const moetier_layer & l, moetier_precision prec);

// unpadded bytes of one expert over its projections
uint64_t moetier_read_bytes(const moetier_layer & l, moetier_precision prec);

// performs r (bb: this thread's bounce buffer for unaligned GGUF ranges) and checks it; false + err
// (MOETIER_ERROR_IO for a failed read, MOETIER_ERROR_STORE for a checksum mismatch)
bool moetier_read_run(const moetier_read & r, moetier_aligned_buffer & bb, moetier_error & err) noexcept;

// every projection of expert e into slot s, checked
bool moetier_read_expert(const moetier_layer &    l,
                         moetier_precision        prec,
                         int32_t                  e,
                         int32_t                  s,
                         moetier_aligned_buffer & bb,
                         moetier_error &          err) noexcept;

// whether a read of layer l in precision prec has checksums to check (a store's; a GGUF's has none)
inline bool moetier_read_checked(const moetier_layer & l, moetier_precision prec) {
    return !l.file_order[prec].empty();
}

// the checksums of every projection of expert e in slot s (nothing to check when reading a GGUF),
// then, if they match, the slot made ready for the kernels (moetier_read_settle; bb: this thread's
// buffer for it)
bool moetier_read_verify(const moetier_layer &    l,
                         moetier_precision        prec,
                         int32_t                  e,
                         int32_t                  s,
                         moetier_aligned_buffer & bb,
                         moetier_error &          err) noexcept;

// Makes what a read just moved into slot s of projection p's pool (the file's bytes, checked) what
// the pool's kernels take: a pool on llama.cpp's repacked CPU kernels (moetier_slots::use_repacked)
// has it repacked in place through bb; a plain pool is left as read. Every read goes through here
// exactly once, after its check: the checksums are the file's bytes. false + err if bb cannot grow.
bool moetier_read_settle(const moetier_proj &     p,
                         moetier_precision        prec,
                         int32_t                  s,
                         moetier_aligned_buffer & bb,
                         moetier_error &          err) noexcept;

// The I/O pool's callbacks for a task (task.layer is a moetier_layer): an I/O thread reads the whole
// expert (bb: the thread's bounce buffer); the ring prepares it as one vectored O_DIRECT read of a
// store, or a read per projection of a GGUF into the task's staging buffer, and copies it into the
// slot (a GGUF's) once read. An I/O thread checks a store's read against its checksums; a ring read
// is left unchecked (the cache checks it where a layer uses it). On success each adds the bytes read
// to task.bytes_done, if set.
bool moetier_read_io(const moetier_io_task & task, moetier_aligned_buffer & bb, std::string & err) noexcept;
bool moetier_read_io_prep(const moetier_io_task & task, moetier_io_vec_read & rd, std::string & err) noexcept;
bool moetier_read_io_finish(const moetier_io_task & task, const moetier_io_vec_read & rd, std::string & err) noexcept;

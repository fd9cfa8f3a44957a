#include "moetier-read.h"

#include <algorithm>
#include <cstring>

// the address of slot s in projection p's pool of precision prec
static uint8_t * moetier_slot_data(const moetier_proj & p, moetier_precision prec, int32_t s) {
    const ggml_tensor * pool = p.pool[prec];
    return (uint8_t *) pool->data + (uint64_t) s * pool->nb[2];
}

int32_t moetier_read_parts(const moetier_layer & l, moetier_precision prec) {
    return l.file_order[prec].empty() ? (int32_t) l.projs.size() : 1;
}

uint64_t moetier_read_bytes(const moetier_layer & l, moetier_precision prec) {
    uint64_t n = 0;
    for (const auto & p : l.projs) {
        n += p.expert_bytes(prec);
    }
    return n;
}

// fault injection (moetier-io.h): one byte of what was just read into slot s goes bad
static void moetier_read_maybe_flip(const moetier_proj & p, moetier_precision prec, int32_t e, int32_t s) {
    if (p.store && moetier_fault(MOETIER_FAULT_FLIP, p.expert_offset(e, prec))) {
        moetier_slot_data(p, prec, s)[p.expert_bytes(prec) / 2] ^= 0x10;
    }
}

// one read (of an expert, or of one of its projections) was checked against the store's checksums
static void moetier_read_count_check(const moetier_layer & l, bool checked) {
    if (checked && l.n_checked) {
        l.n_checked->fetch_add(1, std::memory_order_relaxed);
    }
}

static bool moetier_read_verify_proj(const moetier_layer & l,
                                     const moetier_proj &  p,
                                     moetier_precision     prec,
                                     int32_t               e,
                                     int32_t               s,
                                     bool &                checked,
                                     moetier_error &       err) {
    if (!p.store) {
        return true;
    }
    std::atomic<bool> * done = p.verified[prec] ? &p.verified[prec][e] : nullptr;
    if (!l.verify_all && done && done->load(std::memory_order_relaxed)) {
        return true;
    }
    checked = true;
    if (p.store_of(e)->checksum_of(moetier_slot_data(p, prec, s), p.expert_bytes(prec)) != p.expert_checksum(e, prec)) {
        err.set(MOETIER_ERROR_STORE,
                format("%s: checksum mismatch for layer %d expert %d (%s, %s precision): the store is damaged; "
                       "restore the file or re-run `moetier pack`",
                       p.file_of(e)->path().c_str(), l.il, p.n_local ? e % p.n_local : e, p.meta->name,
                       prec == MOETIER_PRECISION_LOW ? "low" : "high"));
        return false;
    }
    if (done) {
        done->store(true, std::memory_order_relaxed);
    }
    return true;
}

// src (one expert of p's pool, in the file's layout) repacked into slot s (repacked pools only)
static void moetier_read_repack(const moetier_proj & p, moetier_precision prec, int32_t s, const void * src) {
    const ggml_tensor * pool = p.pool[prec];
    // one expert as a tensor of the pool's type, rows, buffer and kernel traits: the buffer's
    // set_tensor repacks its source into the tensor's data
    ggml_tensor         t    = *pool;
    t.ne[2] = t.ne[3] = 1;
    t.nb[3]           = t.nb[2];
    t.data            = moetier_slot_data(p, prec, s);
    t.view_src        = nullptr;
    t.view_offs       = 0;
    GGML_ASSERT(ggml_nbytes(&t) == p.expert_bytes(prec));
    ggml_backend_tensor_set(&t, src, 0, ggml_nbytes(&t));
}

bool moetier_read_settle(const moetier_proj &     p,
                         moetier_precision        prec,
                         int32_t                  s,
                         moetier_aligned_buffer & bb,
                         moetier_error &          err) noexcept {
    const ggml_tensor * pool = p.pool[prec];
    if (pool == nullptr || pool->extra == nullptr) {
        return true;
    }
    const uint64_t bytes = p.expert_bytes(prec);
    try {
        bb.reserve((size_t) bytes);
    } catch (...) {
        err.set(MOETIER_ERROR_IO, "out of memory for the repack buffer");
        return false;
    }
    memcpy(bb.data.get(), moetier_slot_data(p, prec, s), bytes);
    moetier_read_repack(p, prec, s, bb.data.get());
    return true;
}

bool moetier_read_verify(const moetier_layer &    l,
                         moetier_precision        prec,
                         int32_t                  e,
                         int32_t                  s,
                         moetier_aligned_buffer & bb,
                         moetier_error &          err) noexcept {
    bool checked = false;
    bool ok      = true;
    for (const auto & p : l.projs) {
        if (!moetier_read_verify_proj(l, p, prec, e, s, checked, err)) {
            ok = false;
            break;
        }
    }
    moetier_read_count_check(l, checked);
    for (size_t k = 0; k < l.projs.size() && ok; ++k) {
        ok = moetier_read_settle(l.projs[k], prec, s, bb, err);
    }
    return ok;
}

// a failed read's message (the file, the offset, the reason) with the layer and expert it was for
static std::string moetier_read_what(const std::string &   msg,
                                     const moetier_layer & l,
                                     const moetier_proj &  p,
                                     moetier_precision     prec,
                                     int32_t               e) {
    return format("%s (layer %d expert %d, %s, %s precision)", msg.c_str(), l.il, p.n_local ? e % p.n_local : e,
                  p.meta->name, prec == MOETIER_PRECISION_LOW ? "low" : "high");
}

static bool moetier_read_run_untimed(const moetier_read &     r,
                                     moetier_aligned_buffer & bb,
                                     moetier_error &          err) noexcept {
    const moetier_layer & l = *r.layer;
    std::string           msg;
    if (r.proj == MOETIER_READ_ALL) {
        // a store keeps an expert's projections back to back and padded: one vectored O_DIRECT
        // read straight into the slots of the projection pools
        const std::vector<int32_t> & order = l.file_order[r.prec];
        moetier_iovec                iov[8];
        const int                    n = (int) order.size();
        for (int k = 0; k < n; ++k) {
            const moetier_proj & p = l.projs[order[k]];
            iov[k].base            = moetier_slot_data(p, r.prec, r.slot);
            iov[k].len             = moetier_align_up(p.expert_bytes(r.prec));
        }
        const moetier_proj & first = l.projs[order[0]];
        if (!first.file_of(r.expert)->readv(iov, n, first.expert_offset(r.expert, r.prec), msg)) {
            err.set(MOETIER_ERROR_IO, moetier_read_what(msg, l, first, r.prec, r.expert));
            return false;
        }
        moetier_read_maybe_flip(first, r.prec, r.expert, r.slot);
        return moetier_read_verify(l, r.prec, r.expert, r.slot, bb, err);
    }
    const moetier_proj & p     = l.projs[r.proj];
    const uint64_t       bytes = p.expert_bytes(r.prec);
    try {
        // one-time growth per thread; bounded by the largest projection
        bb.reserve(std::max<size_t>(2 * MOETIER_ALIGN, moetier_align_up(bytes) + 2 * MOETIER_ALIGN));
    } catch (...) {
        err.set(MOETIER_ERROR_IO, "out of memory for the read buffer");
        return false;
    }
    // a store's slices are padded: read whole blocks straight into the slot
    const size_t n = p.store ? (size_t) moetier_align_up(bytes) : (size_t) bytes;
    if (!p.file_of(r.expert)->read(moetier_slot_data(p, r.prec, r.slot), p.expert_offset(r.expert, r.prec), n, bb,
                                   msg)) {
        err.set(MOETIER_ERROR_IO, moetier_read_what(msg, l, p, r.prec, r.expert));
        return false;
    }
    moetier_read_maybe_flip(p, r.prec, r.expert, r.slot);
    bool       checked = false;
    const bool ok      = moetier_read_verify_proj(l, p, r.prec, r.expert, r.slot, checked, err);
    moetier_read_count_check(l, checked);
    return ok && moetier_read_settle(p, r.prec, r.slot, bb, err);
}

bool moetier_read_run(const moetier_read & r, moetier_aligned_buffer & bb, moetier_error & err) noexcept {
    const int64_t t0 = moetier_time_us();
    const bool    ok = moetier_read_run_untimed(r, bb, err);
    if (ok && r.layer->read_hist) {
        r.layer->read_hist->add(moetier_time_us() - t0);
    }
    return ok;
}

bool moetier_read_expert(const moetier_layer &    l,
                         moetier_precision        prec,
                         int32_t                  e,
                         int32_t                  s,
                         moetier_aligned_buffer & bb,
                         moetier_error &          err) noexcept {
    const bool   whole = !l.file_order[prec].empty();
    moetier_read r;
    r.layer  = &l;
    r.prec   = prec;
    r.expert = e;
    r.slot   = s;
    for (int32_t p = 0; p < (whole ? 1 : (int32_t) l.projs.size()); ++p) {
        r.proj = whole ? MOETIER_READ_ALL : p;
        if (!moetier_read_run(r, bb, err)) {
            return false;
        }
    }
    return true;
}

// io_uring: expert e into slot s as one vectored O_DIRECT read; false if the layout does not allow it
static bool moetier_read_prep(const moetier_layer & l,
                              moetier_precision     prec,
                              int32_t               e,
                              int32_t               s,
                              moetier_io_vec_read & rd,
                              std::string &         err) noexcept {
    const std::vector<int32_t> & order = l.file_order[prec];
    if (order.empty() || order.size() > 8) {
        err = "io_uring: the expert is not one contiguous range of the store";
        return false;
    }
    const moetier_proj & first = l.projs[order[0]];
    moetier_io_part &    part  = rd.parts[0];
    rd.n_parts                 = 1;
    part.fd                    = first.file_of(e)->direct_fd();
    part.offset                = first.expert_offset(e, prec);
    part.n_iov                 = (unsigned) order.size();
    part.bytes                 = 0;
    for (size_t k = 0; k < order.size(); ++k) {
        const moetier_proj & p = l.projs[order[k]];
        part.iov[k].iov_base   = moetier_slot_data(p, prec, s);
        part.iov[k].iov_len    = moetier_align_up(p.expert_bytes(prec));
        part.bytes += part.iov[k].iov_len;
    }
    part.need = part.bytes;
    if (part.fd < 0) {
        err = format("%s: io_uring reads need O_DIRECT", first.file_of(e)->path().c_str());
        return false;
    }
    return true;
}

// io_uring from a GGUF: each projection (one, or all of the expert's) is read as the whole blocks
// around it into the staging buffer; moetier_read_unstage copies it into the slot
static bool moetier_read_prep_staged(const moetier_layer & l,
                                     moetier_precision     prec,
                                     int32_t               proj,
                                     int32_t               e,
                                     moetier_io_vec_read & rd,
                                     std::string &         err) noexcept {
    if (rd.stage == nullptr) {
        err = "io_uring: a read from a GGUF needs a staging buffer";
        return false;
    }
    const int32_t n_proj = (int32_t) l.projs.size();
    if ((proj < 0 ? n_proj : 1) > (int32_t) MOETIER_IO_MAX_PARTS) {
        err = "io_uring: an expert of more projections than reads of a task";
        return false;
    }
    size_t at = 0;
    for (int32_t pi = proj < 0 ? 0 : proj; pi < (proj < 0 ? n_proj : proj + 1); ++pi) {
        const moetier_proj & p      = l.projs[pi];
        const uint64_t       offset = p.expert_offset(e, prec);
        const uint64_t       n      = p.expert_bytes(prec);
        if (offset + n > p.file->size()) {
            err = format("%s: file is truncated: wanted %llu bytes at offset %llu, file has %llu bytes",
                         p.file->path().c_str(), (unsigned long long) n, (unsigned long long) offset,
                         (unsigned long long) p.file->size());
            return false;
        }
        if (p.file->direct_fd() < 0) {
            err = format("%s: io_uring reads need O_DIRECT", p.file->path().c_str());
            return false;
        }
        const uint64_t    begin = offset / MOETIER_ALIGN * MOETIER_ALIGN;
        const uint64_t    end   = moetier_align_up(offset + n);
        moetier_io_part & part  = rd.parts[rd.n_parts++];
        part.fd                 = p.file->direct_fd();
        part.offset             = begin;
        part.bytes              = (size_t) (end - begin);
        part.need               = (size_t) (offset + n - begin);  // the last block may end past EOF
        part.n_iov              = 1;
        part.iov[0].iov_base    = rd.stage + at;
        part.iov[0].iov_len     = part.bytes;
        at += part.bytes;
    }
    return true;
}

// the staged projections of a task into its slot
static void moetier_read_unstage(const moetier_io_task & task, const moetier_io_vec_read & rd) {
    const moetier_layer &   l    = *(const moetier_layer *) task.layer;
    const moetier_precision prec = (moetier_precision) task.prec;
    for (unsigned k = 0; k < rd.n_parts; ++k) {
        const moetier_proj &    p    = l.projs[task.proj < 0 ? (int32_t) k : task.proj];
        const moetier_io_part & part = rd.parts[k];
        const uint8_t *         src =
            (const uint8_t *) part.iov[0].iov_base + (p.expert_offset(task.expert, prec) - part.offset);
        if (p.pool[prec]->extra != nullptr) {
            moetier_read_repack(p, prec, task.slot, src);  // settled on the way: nothing to check it against
        } else {
            memcpy(moetier_slot_data(p, prec, task.slot), src, p.expert_bytes(prec));
        }
    }
}

// what a task's read moved, for prefetch accounting
static void moetier_read_io_done(const moetier_io_task & task) {
    if (task.bytes_done) {
        const moetier_layer & l = *(const moetier_layer *) task.layer;
        task.bytes_done->fetch_add(moetier_read_bytes(l, (moetier_precision) task.prec), std::memory_order_relaxed);
    }
}

bool moetier_read_io(const moetier_io_task & task, moetier_aligned_buffer & bb, std::string & err) noexcept {
    moetier_error e;
    if (!moetier_read_expert(*(const moetier_layer *) task.layer, (moetier_precision) task.prec, task.expert, task.slot,
                             bb, e)) {
        err = e.msg;
        return false;
    }
    moetier_read_io_done(task);
    return true;
}

bool moetier_read_io_prep(const moetier_io_task & task, moetier_io_vec_read & rd, std::string & err) noexcept {
    const moetier_layer & l = *(const moetier_layer *) task.layer;
    if (l.file_order[task.prec].empty()) {
        return moetier_read_prep_staged(l, (moetier_precision) task.prec, task.proj, task.expert, rd, err);
    }
    if (task.proj >= 0) {
        err = "io_uring: one projection is not one vectored read of the store";
        return false;
    }
    return moetier_read_prep(l, (moetier_precision) task.prec, task.expert, task.slot, rd, err);
}

bool moetier_read_io_finish(const moetier_io_task & task, const moetier_io_vec_read & rd, std::string & err) noexcept {
    GGML_UNUSED(err);
    const moetier_layer & l = *(const moetier_layer *) task.layer;
    if (l.read_hist && task.t_start_us > 0) {
        l.read_hist->add(moetier_time_us() - task.t_start_us);
    }
    if (l.file_order[task.prec].empty()) {
        moetier_read_unstage(task, rd);  // a GGUF's: nothing to check it against
        moetier_read_io_done(task);
        return true;
    }
    // not checked here, on the thread that reaps the ring: the slot is marked unchecked, and the
    // load op of the layer that uses it checks it on every compute thread (moetier-cache)
    moetier_read_maybe_flip(l.projs[l.file_order[task.prec][0]], (moetier_precision) task.prec, task.expert, task.slot);
    moetier_read_io_done(task);
    return true;
}

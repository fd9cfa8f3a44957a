#pragma once

// CRC32C (Castagnoli, the iSCSI / ext4 / RocksDB checksum) of expert data: with the CPU's CRC
// instructions (SSE4.2 on x86-64, the ARMv8 CRC32 extension on aarch64) over three interleaved lanes,
// or a portable table loop that gives the same values. The store checks every expert read with it.

#include <cstddef>
#include <cstdint>

// CRC32C of n bytes at data, continuing from crc (0 for a new checksum): the standard value
// (initial ~0, final ~0), so moetier_crc32c(0, "123456789", 9) == 0xe3069283
uint32_t moetier_crc32c(uint32_t crc, const void * data, size_t n) noexcept;

// the same with a given implementation: "hw" (fails over to "portable" where the CPU has no CRC
// instructions), "portable"; for tests and the micro-benchmark
uint32_t moetier_crc32c_with(const char * impl, uint32_t crc, const void * data, size_t n) noexcept;

// which implementation moetier_crc32c runs here: "sse4.2", "armv8-crc" or "portable"
const char * moetier_crc32c_impl() noexcept;

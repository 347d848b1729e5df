/* What the AMX kernels share (quant_linear.c's int8 tiles, gemm.c's bfloat16 tiles): the
 * tile configuration's memory layout and the Linux permission to use tile data. */
#ifndef INFLIGHT_AMX_H
#define INFLIGHT_AMX_H
#if defined(__AMX_TILE__)
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* ldtilecfg's 64-byte operand (Intel SDM vol. 2, LDTILECFG): palette 1, bytes a row and rows
 * of each of the eight tiles. */
struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Linux hands a process the tile data state only on request; without it the first tile
 * instruction faults (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). Asked once per
 * file that includes this. */
static int amx_permitted(void) {
    static int state; /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return state > 0;
}

/* Load a configuration: an "m" operand of the whole struct, since GCC 12 drops the stores
 * before _tile_loadconfig, which it takes to read one byte. */
static inline void load_tile_config(const struct tile_config *c) {
    __asm__ volatile("ldtilecfg %0" : : "m"(*c));
}
#endif
#endif

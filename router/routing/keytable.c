/* The compact prefix index's key table operations in C (router/routing/keytable.py, KeyTable; loaded through
 * ctypes by router/routing/keytable_native.py): lookup, insertion and deletion of 64-bit key codes in an
 * open-addressing table with linear probing, for tables with one mask word per tier (up to 64 groups).
 *
 * Layout, as keytable.py keeps it: codes[cap + WINDOW] (0 = empty; the WINDOW slots past the end repeat the
 * first ones), masks[TIERS][cap] of `esize`-byte unsigned words. A key's home slot is code & (cap - 1). Deletion
 * is a backward shift, so the table never holds tombstones.
 *
 * At tens of millions of keys every probe is a cache (and TLB) miss: each loop prefetches the home slots of the
 * codes AHEAD positions on, so the misses of consecutive codes overlap instead of queueing one by one. */

#include <stdint.h>

#define WINDOW 8
#define TIERS 3
#define AHEAD 16

static inline uint64_t mget(const void *m, int esize, int64_t i) {
    switch (esize) {
    case 1: return ((const uint8_t *)m)[i];
    case 2: return ((const uint16_t *)m)[i];
    case 4: return ((const uint32_t *)m)[i];
    default: return ((const uint64_t *)m)[i];
    }
}

static inline void mset(void *m, int esize, int64_t i, uint64_t v) {
    switch (esize) {
    case 1: ((uint8_t *)m)[i] = (uint8_t)v; break;
    case 2: ((uint16_t *)m)[i] = (uint16_t)v; break;
    case 4: ((uint32_t *)m)[i] = (uint32_t)v; break;
    default: ((uint64_t *)m)[i] = v;
    }
}

static inline void set_code(uint64_t *codes, int64_t cap, int64_t i, uint64_t c) {
    codes[i] = c;
    if (i < WINDOW) codes[cap + i] = c; /* the padding repeats the first slots */
}

static inline void prefetch(const uint64_t *codes, const void *masks, int esize, int64_t cap, int row, uint64_t c) {
    uint64_t i = c & (uint64_t)(cap - 1);
    __builtin_prefetch(&codes[i]);
    if (masks) __builtin_prefetch((const char *)masks + ((int64_t)row * cap + (int64_t)i) * esize);
}

/* The slot of each code, -1 where it is absent. */
void kvgrid_kt_find(const uint64_t *codes, int64_t cap, const uint64_t *want, int64_t n, int64_t *out) {
    uint64_t mask = (uint64_t)cap - 1;
    for (int64_t j = 0; j < n && j < AHEAD; j++) prefetch(codes, 0, 0, cap, 0, want[j]);
    for (int64_t j = 0; j < n; j++) {
        if (j + AHEAD < n) prefetch(codes, 0, 0, cap, 0, want[j + AHEAD]);
        uint64_t c = want[j], i = c & mask;
        for (;;) {
            uint64_t s = codes[i];
            if (s == c) { out[j] = (int64_t)i; break; }
            if (!s) { out[j] = -1; break; }
            i = (i + 1) & mask;
        }
    }
}

/* The slot of each code (out may be NULL), putting the absent ones into empty slots; with masks, ORs `value` into
 * tier `row`'s word of each code's slot. The caller has made room (no growth here). Returns how many were new. */
int64_t kvgrid_kt_insert(uint64_t *codes, void *masks, int esize, int64_t cap, const uint64_t *want, int64_t n,
                         int row, uint64_t value, int64_t *out) {
    uint64_t mask = (uint64_t)cap - 1;
    int64_t placed = 0, base = (int64_t)row * cap;
    for (int64_t j = 0; j < n && j < AHEAD; j++) prefetch(codes, masks, esize, cap, row, want[j]);
    for (int64_t j = 0; j < n; j++) {
        if (j + AHEAD < n) prefetch(codes, masks, esize, cap, row, want[j + AHEAD]);
        uint64_t c = want[j], i = c & mask;
        for (;;) {
            uint64_t s = codes[i];
            if (s == c) break;
            if (!s) {
                set_code(codes, cap, (int64_t)i, c);
                placed++;
                break;
            }
            i = (i + 1) & mask;
        }
        if (masks) mset(masks, esize, base + (int64_t)i, mget(masks, esize, base + (int64_t)i) | value);
        if (out) out[j] = (int64_t)i;
    }
    return placed;
}

/* Clear `value` in tier `row`'s word of each code's slot (absent codes are skipped); a slot left with no bit in
 * any tier (in row 0 alone when `tiered` is 0: no key was ever held below the GPU pool) is emptied by a backward
 * shift: each later entry of its cluster whose home is not between the hole and itself moves back into the hole,
 * masks and all. With value 0 this just empties the given codes whose masks are zero. Returns the slots emptied. */
int64_t kvgrid_kt_remove(uint64_t *codes, void *masks, int esize, int64_t cap, const uint64_t *want, int64_t n,
                         int row, uint64_t value, int tiered) {
    uint64_t mask = (uint64_t)cap - 1;
    int64_t emptied = 0, at = (int64_t)row * cap;
    for (int64_t j = 0; j < n && j < AHEAD; j++) prefetch(codes, masks, esize, cap, row, want[j]);
    for (int64_t j = 0; j < n; j++) {
        if (j + AHEAD < n) prefetch(codes, masks, esize, cap, row, want[j + AHEAD]);
        uint64_t c = want[j], i = c & mask, s;
        while ((s = codes[i]) != c && s) i = (i + 1) & mask;
        if (s != c) continue;
        uint64_t left = mget(masks, esize, at + (int64_t)i) & ~value;
        mset(masks, esize, at + (int64_t)i, left);
        if (mget(masks, esize, (int64_t)i)) continue;
        if (tiered && (mget(masks, esize, cap + (int64_t)i) || mget(masks, esize, 2 * cap + (int64_t)i))) continue;
        uint64_t hole = i, k = i;
        for (;;) {
            k = (k + 1) & mask;
            uint64_t x = codes[k];
            if (!x) break;
            if ((((x & mask) - hole - 1) & mask) < ((k - hole) & mask)) continue; /* home in (hole, k]: stays */
            set_code(codes, cap, (int64_t)hole, x);
            for (int r = 0; r < TIERS; r++)
                mset(masks, esize, r * cap + (int64_t)hole, mget(masks, esize, r * cap + (int64_t)k));
            hole = k;
        }
        set_code(codes, cap, (int64_t)hole, 0);
        for (int r = 0; r < TIERS; r++) mset(masks, esize, r * cap + (int64_t)hole, 0);
        emptied++;
    }
    return emptied;
}

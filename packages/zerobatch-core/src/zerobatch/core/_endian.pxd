# Declaration-only: little-endian loads and stores for on-disk integers.
#
# On-disk integers are never read through a cast pointer (unaligned access is undefined
# behaviour in C); memcpy into a local compiles to a single load on every platform we build
# for, plus a byte swap on big-endian hosts.

from libc.stdint cimport uint8_t, uint32_t, uint64_t

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__BYTE_ORDER__) && (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__)
    #define ZB_BIG_ENDIAN 1
    #else
    #define ZB_BIG_ENDIAN 0
    #endif
    static inline uint32_t zb_load_u32le(const uint8_t *p) {
        uint32_t v; memcpy(&v, p, 4);
    #if ZB_BIG_ENDIAN
        v = __builtin_bswap32(v);
    #endif
        return v;
    }
    static inline uint64_t zb_load_u64le(const uint8_t *p) {
        uint64_t v; memcpy(&v, p, 8);
    #if ZB_BIG_ENDIAN
        v = __builtin_bswap64(v);
    #endif
        return v;
    }
    static inline void zb_store_u32le(uint8_t *p, uint32_t v) {
    #if ZB_BIG_ENDIAN
        v = __builtin_bswap32(v);
    #endif
        memcpy(p, &v, 4);
    }
    static inline void zb_store_u64le(uint8_t *p, uint64_t v) {
    #if ZB_BIG_ENDIAN
        v = __builtin_bswap64(v);
    #endif
        memcpy(p, &v, 8);
    }
    """
    bint ZB_BIG_ENDIAN
    uint32_t zb_load_u32le(const uint8_t *p) noexcept nogil
    uint64_t zb_load_u64le(const uint8_t *p) noexcept nogil
    void zb_store_u32le(uint8_t *p, uint32_t v) noexcept nogil
    void zb_store_u64le(uint8_t *p, uint64_t v) noexcept nogil

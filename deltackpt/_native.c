/* deltackpt._native: the loops numpy cannot fuse (an element-sparse delta; a linear digest).
 *
 * diff_sparse(new, base, itemsize, idx_out, val_out[, lin_out, plain, update]) -> k
 *   Walks two equal-length byte buffers 8 bytes at a time (a mask of the words that differ per
 *   64, with AVX2 where the processor has it); for every element whose bytes
 *   differ, appends its element index (uint32) to idx_out and its new bytes to val_out.
 *   Returns the number of changed elements, or -1 when idx_out / val_out have room for fewer
 *   (the caller then encodes the piece another way). One pass over both inputs at memory speed,
 *   with the GIL released; numpy needs five passes and an index array of every changed word.
 *   update: base becomes new as the loop goes (a sync sender's kept base), each changed word
 *   written while its line is in cache instead of a scatter pass afterwards.
 *
 * unpack_gaps(planes, n, idx_out) -> (status, j): a patch's index list from its byte-grouped
 *   gaps, summed and validated in one pass.
 *
 * Why C: numpy's compare runs at ~13 GB/s here but the nonzero/gather/expand steps around it
 * bring a sparse extraction down to ~2 GB/s per core, slower than a loopback link, so a delta
 * round would cost more than the bytes it saves. Built at install time (setup.py, optional);
 * deltackpt.sync.delta_codec falls back to numpy without it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int get(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Format(PyExc_TypeError, "_native: %s must be a C-contiguous%s buffer", what,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* The linear digest (deltackpt.format.lindigest): two 64-bit lanes, each the sum mod 2**64 over
 * the 8-byte little-endian words w_i of a buffer (its tail zero-padded) of
 * fmix64(w_i ^ (i * M + S)), murmur3's finalizer. A sum, so a patch updates it from the old and
 * new values of the words it touched alone. */
#define LIN_M0 0x9E3779B97F4A7C15ULL
#define LIN_S0 0x243F6A8885A308D3ULL
#define LIN_M1 0xD6E8FEB86659FD93ULL
#define LIN_S1 0x13198A2E03707344ULL

static inline uint64_t fmix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}

/* word i changed from old to new: lin[0..1] += old's terms, lin[2..3] += new's */
static inline void lin_word(uint64_t *lin, uint64_t i, uint64_t old, uint64_t new) {
    const uint64_t k0 = LIN_S0 + i * LIN_M0, k1 = LIN_S1 + i * LIN_M1;
    lin[0] += fmix64(old ^ k0);
    lin[1] += fmix64(old ^ k1);
    lin[2] += fmix64(new ^ k0);
    lin[3] += fmix64(new ^ k1);
}

/* Bit j set where word j of the m (<= 64) 8-byte words at a and b differ: plain, and with
 * AVX2 (four words per compare) where the processor has it, chosen at run time. */
static uint64_t neq_mask_plain(const uint8_t *a, const uint8_t *b, int m) {
    uint64_t mask = 0;
    for (int j = 0; j < m; j++) {
        uint64_t x, y;
        memcpy(&x, a + 8 * j, 8);
        memcpy(&y, b + 8 * j, 8);
        mask |= (uint64_t)(x != y) << j;
    }
    return mask;
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx2"))) static uint64_t neq_mask_avx2(const uint8_t *a, const uint8_t *b,
                                                               int m) {
    uint64_t mask = 0;
    int j = 0;
    for (; j + 4 <= m; j += 4) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(a + 8 * j));
        const __m256i y = _mm256_loadu_si256((const __m256i *)(b + 8 * j));
        const int eq = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(x, y)));
        mask |= (uint64_t)(~eq & 0xF) << j;
    }
    if (j < m) mask |= neq_mask_plain(a + 8 * j, b + 8 * j, m - j) << j;
    return mask;
}
#endif

#if defined(__GNUC__)
#define CTZ64(x) __builtin_ctzll(x)
#else
static int CTZ64(uint64_t x) { /* x != 0 */
    int n = 0;
    while (!(x & 1)) x >>= 1, n++;
    return n;
}
#endif

static int use_avx2 = -1; /* -1: not looked yet (a benign race: every thread finds the same) */

static uint64_t neq_mask(const uint8_t *a, const uint8_t *b, int m, int plain) {
#if defined(__GNUC__) && defined(__x86_64__)
    if (use_avx2 < 0) use_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    if (use_avx2 && !plain) return neq_mask_avx2(a, b, m);
#endif
    return neq_mask_plain(a, b, m);
}

/* One element type T per itemsize: the words of a block of 64 are compared first, without a
 * branch, into a mask of those that differ; then only those are visited (count trailing zeros),
 * and in each every element is written out and kept (k advances) only if it changed, without a
 * branch per element (the changed ones are scattered at random: branches would mispredict).
 * An RL step changes ~2% of the elements (~9% of the bf16 words): the work follows them, and
 * equal words cost a compare, not a mispredicted branch. */
#define DIFF(NAME, T)                                                                        \
    static Py_ssize_t NAME(const uint8_t *a, const uint8_t *b, Py_ssize_t n, uint32_t *idx, \
                           Py_ssize_t cap, uint8_t *vals_, uint64_t *lin, int plain,       \
                           uint8_t *out) {                                                  \
        T *vals = (T *)vals_;                                                               \
        const Py_ssize_t per = 8 / (Py_ssize_t)sizeof(T), words = n / 8;                   \
        Py_ssize_t k = 0;                                                                   \
        uint64_t acc[4] = {0, 0, 0, 0}; /* in registers: lin may alias the buffers */     \
        for (Py_ssize_t w0 = 0; w0 < words; w0 += 64) {                                     \
            const int m = words - w0 < 64 ? (int)(words - w0) : 64;                         \
            uint64_t mask = neq_mask(a + 8 * w0, b + 8 * w0, m, plain);                     \
            while (mask) {                                                                  \
                const Py_ssize_t w = w0 + CTZ64(mask);                                      \
                mask &= mask - 1;                                                           \
                uint64_t x, y;                                                              \
                memcpy(&x, a + 8 * w, 8);                                                   \
                memcpy(&y, b + 8 * w, 8);                                                   \
                if (k + per > cap) return -1;                                               \
                if (lin) lin_word(acc, (uint64_t)w, y, x);                                  \
                for (Py_ssize_t e = 0; e < per; e++) {                                      \
                    T u, v;                                                                 \
                    memcpy(&u, a + 8 * w + e * sizeof(T), sizeof(T));                      \
                    memcpy(&v, b + 8 * w + e * sizeof(T), sizeof(T));                      \
                    idx[k] = (uint32_t)(w * per + e);                                       \
                    vals[k] = u;                                                            \
                    k += (u != v);                                                          \
                }                                                                           \
                if (out) memcpy(out + 8 * w, &x, 8); /* the base becomes new, in cache */    \
            }                                                                               \
        }                                                                                   \
        if (lin && n > words * 8 && memcmp(a + words * 8, b + words * 8, n - words * 8)) {  \
            uint64_t x = 0, y = 0; /* the tail word, zero-padded */                         \
            memcpy(&x, a + words * 8, (size_t)(n - words * 8));                             \
            memcpy(&y, b + words * 8, (size_t)(n - words * 8));                             \
            lin_word(acc, (uint64_t)words, y, x);                                           \
        }                                                                                   \
        if (lin)                                                                            \
            for (int q = 0; q < 4; q++) lin[q] += acc[q];                                   \
        for (Py_ssize_t i = words * 8; i < n; i += sizeof(T)) { /* the tail (< 8 bytes) */ \
            T u, v;                                                                         \
            memcpy(&u, a + i, sizeof(T));                                                   \
            memcpy(&v, b + i, sizeof(T));                                                   \
            if (u != v) {                                                                   \
                if (k >= cap) return -1;                                                    \
                if (out) memcpy(out + i, &u, sizeof(T));                                    \
                idx[k] = (uint32_t)(i / sizeof(T));                                         \
                vals[k++] = u;                                                              \
            }                                                                               \
        }                                                                                   \
        return k;                                                                           \
    }

DIFF(diff1, uint8_t)
DIFF(diff2, uint16_t)
DIFF(diff4, uint32_t)
DIFF(diff8, uint64_t)

static Py_ssize_t diff(const uint8_t *a, const uint8_t *b, Py_ssize_t n, int itemsize,
                       uint32_t *idx, Py_ssize_t cap, uint8_t *vals, uint64_t *lin, int plain,
                       uint8_t *out) {
    switch (itemsize) {
    case 1: return diff1(a, b, n, idx, cap, vals, lin, plain, out);
    case 2: return diff2(a, b, n, idx, cap, vals, lin, plain, out);
    case 4: return diff4(a, b, n, idx, cap, vals, lin, plain, out);
    default: return diff8(a, b, n, idx, cap, vals, lin, plain, out);
    }
}

static PyObject *diff_sparse(PyObject *self, PyObject *args) {
    PyObject *o_new, *o_base, *o_idx, *o_val, *o_lin = Py_None;
    int itemsize, plain = 0, update = 0;
    if (!PyArg_ParseTuple(args, "OOiOO|Opp", &o_new, &o_base, &itemsize, &o_idx, &o_val, &o_lin,
                          &plain, &update))
        return NULL;
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "diff_sparse: itemsize %d, expected 1, 2, 4 or 8", itemsize);
        return NULL;
    }
    Py_buffer vn, vb, vi, vv;
    if (get(o_new, &vn, 0, "new") < 0) return NULL;
    if (get(o_base, &vb, update, "base") < 0) { PyBuffer_Release(&vn); return NULL; }
    if (get(o_idx, &vi, 1, "idx_out") < 0) { PyBuffer_Release(&vn); PyBuffer_Release(&vb); return NULL; }
    if (get(o_val, &vv, 1, "val_out") < 0) {
        PyBuffer_Release(&vn); PyBuffer_Release(&vb); PyBuffer_Release(&vi); return NULL;
    }
    Py_buffer vl;
    uint64_t *lin = NULL;
    if (o_lin != Py_None) {
        if (get(o_lin, &vl, 1, "lin_out") < 0) {
            PyBuffer_Release(&vn); PyBuffer_Release(&vb); PyBuffer_Release(&vi);
            PyBuffer_Release(&vv); return NULL;
        }
        if (vl.len < 32) {
            PyErr_SetString(PyExc_ValueError, "diff_sparse: lin_out needs 4 uint64");
            PyBuffer_Release(&vn); PyBuffer_Release(&vb); PyBuffer_Release(&vi);
            PyBuffer_Release(&vv); PyBuffer_Release(&vl); return NULL;
        }
        lin = (uint64_t *)vl.buf;
    }
    Py_ssize_t n = vn.len, k = -2;
    if (vb.len != n || n % itemsize != 0 || n / itemsize > 0xFFFFFFFFLL) {
        PyErr_Format(PyExc_ValueError,
                     "diff_sparse: new has %zd bytes, base %zd, itemsize %d: expected equal "
                     "lengths, whole elements, at most 2**32 of them", n, vb.len, itemsize);
    } else {
        Py_ssize_t cap = vi.len / 4;
        if (vv.len / itemsize < cap) cap = vv.len / itemsize;
        Py_BEGIN_ALLOW_THREADS
        k = diff((const uint8_t *)vn.buf, (const uint8_t *)vb.buf, n, itemsize,
                 (uint32_t *)vi.buf, cap, (uint8_t *)vv.buf, lin, plain,
                 update ? (uint8_t *)vb.buf : NULL);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&vn); PyBuffer_Release(&vb); PyBuffer_Release(&vi); PyBuffer_Release(&vv);
    if (lin) PyBuffer_Release(&vl);
    if (k == -2) return NULL;
    return PyLong_FromSsize_t(k);
}

#define LIN_WORDS(NAME, ATTR)                                                                 \
    ATTR static void NAME(const uint8_t *buf, Py_ssize_t n, uint64_t *s0, uint64_t *s1) {  \
        uint64_t a = 0, b = 0;                                                               \
        const Py_ssize_t words = n / 8;                                                      \
        for (Py_ssize_t i = 0; i < words; i++) {                                             \
            uint64_t w;                                                                      \
            memcpy(&w, buf + 8 * i, 8);                                                      \
            a += fmix64(w ^ (LIN_S0 + (uint64_t)i * LIN_M0));                                \
            b += fmix64(w ^ (LIN_S1 + (uint64_t)i * LIN_M1));                                \
        }                                                                                    \
        if (n > words * 8) {                                                                 \
            uint64_t w = 0;                                                                  \
            memcpy(&w, buf + 8 * words, (size_t)(n - 8 * words));                            \
            a += fmix64(w ^ (LIN_S0 + (uint64_t)words * LIN_M0));                            \
            b += fmix64(w ^ (LIN_S1 + (uint64_t)words * LIN_M1));                            \
        }                                                                                    \
        *s0 = a;                                                                             \
        *s1 = b;                                                                             \
    }

/* The same loop twice: plain, and compiled for AVX-512 (8 words per 64-bit vector multiply),
 * chosen at run time where the processor has it; both give the same sums. */
LIN_WORDS(lin_words_plain, )
#if defined(__GNUC__) && defined(__x86_64__)
LIN_WORDS(lin_words_avx512, __attribute__((target("avx512f,avx512dq"))))
#endif

static void lin_words(const uint8_t *buf, Py_ssize_t n, uint64_t *s0, uint64_t *s1, int plain) {
#if defined(__GNUC__) && defined(__x86_64__)
    if (!plain && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) {
        lin_words_avx512(buf, n, s0, s1);
        return;
    }
#endif
    lin_words_plain(buf, n, s0, s1);
}

static PyObject *lin_sum(PyObject *self, PyObject *args) {
    PyObject *o;
    int plain = 0;
    if (!PyArg_ParseTuple(args, "O|p", &o, &plain)) return NULL;
    Py_buffer v;
    if (get(o, &v, 0, "buf") < 0) return NULL;
    uint64_t a, b;
    Py_BEGIN_ALLOW_THREADS
    lin_words((const uint8_t *)v.buf, v.len, &a, &b, plain);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return Py_BuildValue("(KK)", (unsigned long long)a, (unsigned long long)b);
}

/* lin_terms(idx, words) -> (lane 0, lane 1): the terms of the words words[j] at word indices
 * idx[j] (int64, uint64 arrays of one length), summed. */
static PyObject *lin_terms(PyObject *self, PyObject *args) {
    PyObject *oi, *ow;
    if (!PyArg_ParseTuple(args, "OO", &oi, &ow)) return NULL;
    Py_buffer vi, vw;
    if (get(oi, &vi, 0, "idx") < 0) return NULL;
    if (get(ow, &vw, 0, "words") < 0) { PyBuffer_Release(&vi); return NULL; }
    if (vi.len != vw.len || vi.len % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "lin_terms: idx has %zd bytes, words %zd: expected two "
                     "arrays of 8-byte items of one length", vi.len, vw.len);
        PyBuffer_Release(&vi); PyBuffer_Release(&vw);
        return NULL;
    }
    uint64_t a = 0, b = 0;
    const Py_ssize_t n = vi.len / 8;
    const uint8_t *pi = (const uint8_t *)vi.buf, *pw = (const uint8_t *)vw.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t i, w;
        memcpy(&i, pi + 8 * j, 8);
        memcpy(&w, pw + 8 * j, 8);
        a += fmix64(w ^ (LIN_S0 + i * LIN_M0));
        b += fmix64(w ^ (LIN_S1 + i * LIN_M1));
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vi); PyBuffer_Release(&vw);
    return Py_BuildValue("(KK)", (unsigned long long)a, (unsigned long long)b);
}

/* lin_at(buf, idx) -> (lane 0, lane 1): the terms of buf's words at word indices idx (int64,
 * each < ceil(len / 8); the last word zero-padded), summed: the words are read in place. */
static PyObject *lin_at(PyObject *self, PyObject *args) {
    PyObject *ob, *oi;
    if (!PyArg_ParseTuple(args, "OO", &ob, &oi)) return NULL;
    Py_buffer vb, vi;
    if (get(ob, &vb, 0, "buf") < 0) return NULL;
    if (get(oi, &vi, 0, "idx") < 0) { PyBuffer_Release(&vb); return NULL; }
    const Py_ssize_t n = vi.len / 8, len = vb.len, words = (len + 7) / 8;
    const uint8_t *pb = (const uint8_t *)vb.buf, *pi = (const uint8_t *)vi.buf;
    uint64_t a = 0, b = 0;
    int bad = vi.len % 8 != 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n && !bad; j++) {
        int64_t i;
        memcpy(&i, pi + 8 * j, 8);
        if (i < 0 || i >= words) { bad = 1; break; }
        uint64_t w = 0;
        Py_ssize_t at = 8 * (Py_ssize_t)i, m = len - at < 8 ? len - at : 8;
        memcpy(&w, pb + at, (size_t)m);
        a += fmix64(w ^ (LIN_S0 + (uint64_t)i * LIN_M0));
        b += fmix64(w ^ (LIN_S1 + (uint64_t)i * LIN_M1));
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vb); PyBuffer_Release(&vi);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "lin_at: idx must be int64 word indices below %zd", words);
        return NULL;
    }
    return Py_BuildValue("(KK)", (unsigned long long)a, (unsigned long long)b);
}

/* patch_apply(buf, idx, vals, itemsize, old_out[, lin_out]): write vals[j] at element idx[j]
 * of buf (int64 indices, strictly increasing, validated by the caller), keeping the values
 * overwritten in old_out; lin_out (4 uint64) accumulates the linear-digest terms of every word
 * touched, before (lanes 0, 1) and after (2, 3). One pass: the old word is read, its elements
 * written, the new word read, while the line is in cache. Returns -1 (nothing written) when an
 * index is out of range or not increasing. */
#define APPLY(NAME, T)                                                                       \
    static Py_ssize_t NAME(uint8_t *buf, Py_ssize_t len, const int64_t *idx, Py_ssize_t k,  \
                           const uint8_t *vals_, uint8_t *old_, uint64_t *lin) {            \
        const T *vals = (const T *)vals_;                                                    \
        T *old = (T *)old_;                                                                  \
        const int64_t n = len / (Py_ssize_t)sizeof(T), per = 8 / (int64_t)sizeof(T);         \
        for (Py_ssize_t j = 0; j < k; j++)                                                   \
            if (idx[j] < 0 || idx[j] >= n || (j && idx[j] <= idx[j - 1])) return -1;        \
        /* 1. a flat gather/scatter loop (independent loads: many misses in flight) */      \
        for (Py_ssize_t j = 0; j < k; j++) {                                                 \
            memcpy(&old[j], buf + idx[j] * sizeof(T), sizeof(T));                           \
            memcpy(buf + idx[j] * sizeof(T), &vals[j], sizeof(T));                           \
        }                                                                                    \
        if (!lin) return k;                                                                  \
        /* 2. per touched word, now in cache: its new value, and its old one rebuilt by     \
         * putting the kept elements back in a register */                                  \
        Py_ssize_t j = 0;                                                                    \
        uint64_t acc[4] = {0, 0, 0, 0}; /* in registers: lin may alias buf for the compiler */ \
        while (j < k) {                                                                      \
            const int64_t w = idx[j] / per;                                                  \
            const Py_ssize_t at = 8 * (Py_ssize_t)w;                                         \
            uint64_t after = 0;                                                              \
            if (len - at >= 8) memcpy(&after, buf + at, 8);                                  \
            else memcpy(&after, buf + at, (size_t)(len - at));                               \
            uint64_t before = after; /* little-endian words, as the format */               \
            for (; j < k && idx[j] / per == w; j++) {                                        \
                const unsigned sh = (unsigned)((idx[j] - w * per) * sizeof(T) * 8);         \
                const uint64_t mask = sizeof(T) == 8 ? ~0ULL : ((1ULL << (sizeof(T) * 8)) - 1); \
                before = (before & ~(mask << sh)) | ((uint64_t)old[j] << sh);                \
            }                                                                                \
            lin_word(acc, (uint64_t)w, before, after);                                       \
        }                                                                                    \
        for (int q = 0; q < 4; q++) lin[q] += acc[q];                                        \
        return k;                                                                            \
    }

APPLY(apply1, uint8_t)
APPLY(apply2, uint16_t)
APPLY(apply4, uint32_t)
APPLY(apply8, uint64_t)

static PyObject *patch_apply(PyObject *self, PyObject *args) {
    PyObject *ob, *oi, *ov, *oo, *ol = Py_None;
    int itemsize;
    if (!PyArg_ParseTuple(args, "OOOiO|O", &ob, &oi, &ov, &itemsize, &oo, &ol)) return NULL;
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "patch_apply: itemsize %d, expected 1, 2, 4 or 8", itemsize);
        return NULL;
    }
    Py_buffer vb, vi, vv, vo, vl;
    if (get(ob, &vb, 1, "buf") < 0) return NULL;
    if (get(oi, &vi, 0, "idx") < 0) { PyBuffer_Release(&vb); return NULL; }
    if (get(ov, &vv, 0, "vals") < 0) { PyBuffer_Release(&vb); PyBuffer_Release(&vi); return NULL; }
    if (get(oo, &vo, 1, "old_out") < 0) {
        PyBuffer_Release(&vb); PyBuffer_Release(&vi); PyBuffer_Release(&vv); return NULL;
    }
    uint64_t *lin = NULL;
    int has_lin = ol != Py_None;
    if (has_lin) {
        if (get(ol, &vl, 1, "lin_out") < 0) {
            PyBuffer_Release(&vb); PyBuffer_Release(&vi); PyBuffer_Release(&vv);
            PyBuffer_Release(&vo); return NULL;
        }
        lin = vl.len >= 32 ? (uint64_t *)vl.buf : NULL;
    }
    const Py_ssize_t k = vi.len / 8;
    Py_ssize_t r = -2;
    if (vi.len % 8 || vv.len != k * itemsize || vo.len != k * itemsize || (has_lin && !lin)) {
        PyErr_Format(PyExc_ValueError, "patch_apply: idx %zd bytes, vals %zd, old_out %zd, "
                     "itemsize %d: expected int64 indices, values and room for the old ones of "
                     "one count, lin_out of 4 uint64", vi.len, vv.len, vo.len, itemsize);
    } else {
        uint8_t *b = (uint8_t *)vb.buf, *o = (uint8_t *)vo.buf;
        const int64_t *ix = (const int64_t *)vi.buf;
        const uint8_t *v = (const uint8_t *)vv.buf;
        Py_BEGIN_ALLOW_THREADS
        switch (itemsize) {
        case 1: r = apply1(b, vb.len, ix, k, v, o, lin); break;
        case 2: r = apply2(b, vb.len, ix, k, v, o, lin); break;
        case 4: r = apply4(b, vb.len, ix, k, v, o, lin); break;
        default: r = apply8(b, vb.len, ix, k, v, o, lin); break;
        }
        Py_END_ALLOW_THREADS
        if (r == -1)
            PyErr_SetString(PyExc_ValueError, "patch_apply: an index is out of range or not "
                            "increasing; nothing was written");
    }
    PyBuffer_Release(&vb); PyBuffer_Release(&vi); PyBuffer_Release(&vv); PyBuffer_Release(&vo);
    if (has_lin) PyBuffer_Release(&vl);
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

/* unpack_gaps(planes, n, idx_out) -> (status, j): the index list of a patch payload
 * (format/changes.py) from its k uint32 gaps grouped by byte significance (planes: 4 planes of
 * k bytes, plane b = byte b of every gap), summed into idx_out (k int64) and validated in the
 * same pass: status 1 when gap j (j > 0) is zero (an element named twice), 2 when index j is
 * not below n (the sum is checked before it can wrap). numpy takes four strided copies, a
 * compare and a widening cumsum, ~5x the time. */
static PyObject *unpack_gaps(PyObject *self, PyObject *args) {
    PyObject *op, *oi;
    long long n;
    if (!PyArg_ParseTuple(args, "OLO", &op, &n, &oi)) return NULL;
    Py_buffer vp, vi;
    if (get(op, &vp, 0, "planes") < 0) return NULL;
    if (get(oi, &vi, 1, "idx_out") < 0) { PyBuffer_Release(&vp); return NULL; }
    const Py_ssize_t k = vp.len / 4;
    if (vp.len % 4 || vi.len != 8 * k || n < 0) {
        PyErr_Format(PyExc_ValueError, "unpack_gaps: planes %zd bytes, idx_out %zd, n %lld: "
                     "expected 4 bytes a gap, 8 an index, n >= 0", vp.len, vi.len, n);
        PyBuffer_Release(&vp); PyBuffer_Release(&vi);
        return NULL;
    }
    const uint8_t *p0 = (const uint8_t *)vp.buf, *p1 = p0 + k, *p2 = p1 + k, *p3 = p2 + k;
    int64_t *out = (int64_t *)vi.buf;
    int status = 0;
    Py_ssize_t j = 0;
    Py_BEGIN_ALLOW_THREADS
    uint64_t at = 0;
    for (; j < k; j++) {
        const uint64_t gap = (uint64_t)p0[j] | (uint64_t)p1[j] << 8 | (uint64_t)p2[j] << 16 |
                             (uint64_t)p3[j] << 24;
        if (j && !gap) { status = 1; break; }
        at += gap; /* at < n <= 2**63 before, gap < 2**32: no wrap */
        if (at >= (uint64_t)n) { status = 2; break; }
        out[j] = (int64_t)at;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vp); PyBuffer_Release(&vi);
    return Py_BuildValue("(in)", status, status ? j : (Py_ssize_t)0);
}

/* fp_rows(words, n, p, q, out): the chunk fingerprints of format/fingerprint.py for rows of n
 * 8-byte words (words: rows * n of them, contiguous; p, q: at least n position keys each; out:
 * rows * 2 int64): per row a = sum(m_i), b = sum(m_i * q_i) with m_i = mix(w_i ^ p_i), mix the
 * splitmix64 finaliser, all wrapping: the integers torch computes, in one pass. */
static inline uint64_t fp_mix(uint64_t z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z;
}

static PyObject *fp_rows(PyObject *self, PyObject *args) {
    PyObject *ow, *op, *oq, *oo;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OnOOO", &ow, &n, &op, &oq, &oo)) return NULL;
    Py_buffer vw, vp, vq, vo;
    if (get(ow, &vw, 0, "words") < 0) return NULL;
    if (get(op, &vp, 0, "p") < 0) { PyBuffer_Release(&vw); return NULL; }
    if (get(oq, &vq, 0, "q") < 0) { PyBuffer_Release(&vw); PyBuffer_Release(&vp); return NULL; }
    if (get(oo, &vo, 1, "out") < 0) {
        PyBuffer_Release(&vw); PyBuffer_Release(&vp); PyBuffer_Release(&vq); return NULL;
    }
    Py_ssize_t rows = n > 0 ? vw.len / (8 * n) : 0;
    if (n <= 0 || vw.len != rows * 8 * n || vp.len < 8 * n || vq.len < 8 * n
        || vo.len != rows * 16) {
        PyErr_Format(PyExc_ValueError, "fp_rows: %zd bytes of words in rows of %zd, keys of "
                     "%zd and %zd bytes, out of %zd: expected whole rows, keys for a row, and "
                     "16 bytes of out per row", vw.len, n, vp.len, vq.len, vo.len);
        PyBuffer_Release(&vw); PyBuffer_Release(&vp); PyBuffer_Release(&vq);
        PyBuffer_Release(&vo);
        return NULL;
    }
    const uint8_t *w = (const uint8_t *)vw.buf;
    const uint8_t *pp = (const uint8_t *)vp.buf, *pq = (const uint8_t *)vq.buf;
    uint8_t *out = (uint8_t *)vo.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++) {
        uint64_t a = 0, b = 0;
        const uint8_t *row = w + 8 * n * r;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t x, pk, qk;
            memcpy(&x, row + 8 * i, 8);
            memcpy(&pk, pp + 8 * i, 8);
            memcpy(&qk, pq + 8 * i, 8);
            uint64_t m = fp_mix(x ^ pk);
            a += m;
            b += m * qk;
        }
        memcpy(out + 16 * r, &a, 8);
        memcpy(out + 16 * r + 8, &b, 8);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vw); PyBuffer_Release(&vp); PyBuffer_Release(&vq); PyBuffer_Release(&vo);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fp_rows", fp_rows, METH_VARARGS,
     "fp_rows(words, n, p, q, out): chunk fingerprints of rows of n words into out "
     "(rows x 2 int64), the integers of format/fingerprint.py"},
    {"diff_sparse", diff_sparse, METH_VARARGS,
     "diff_sparse(new, base, itemsize, idx_out, val_out[, lin_out[, plain]]) -> changed "
     "elements, or -1 if they do not fit; lin_out (4 uint64, or None) accumulates the "
     "linear-digest terms of the changed words, old (lanes 0, 1) and new (2, 3); plain: never "
     "the AVX2 compare; update: base (writable) becomes new as the loop goes (on -1 it is "
     "partly written)"},
    {"unpack_gaps", unpack_gaps, METH_VARARGS,
     "unpack_gaps(planes, n, idx_out) -> (status, j): k uint32 index gaps grouped by byte "
     "(4 planes of k bytes) summed into int64 indices; status 0 ok, 1 gap j is zero, 2 index j "
     "is not below n"},
    {"lin_sum", lin_sum, METH_VARARGS,
     "lin_sum(buf[, plain]) -> (lane0, lane1): the linear digest's sums (plain: never the "
     "AVX-512 loop)"},
    {"patch_apply", patch_apply, METH_VARARGS,
     "patch_apply(buf, idx, vals, itemsize, old_out[, lin_out]): write a patch in place, "
     "keeping the old values and summing the touched words' linear-digest terms"},
    {"lin_at", lin_at, METH_VARARGS,
     "lin_at(buf, idx) -> (lane0, lane1): the terms of buf's words at idx, summed"},
    {"lin_terms", lin_terms, METH_VARARGS,
     "lin_terms(idx, words) -> (lane0, lane1): the terms of the given words, summed"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }

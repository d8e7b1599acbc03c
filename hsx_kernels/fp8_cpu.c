/* The CPU quantizer's kernel: bf16 rows to e4m3 bits and power-of-two scales.
 *
 * Integer arithmetic on the bf16 bits, 32 values at a time in 16-bit lanes, without the GIL.
 * One loop per row quantizes it (its largest magnitude is known by then) and finds the next
 * row's largest magnitude. The bytes are those of hsx_store/fp8.py `quantize_rows` (the
 * definition, which the GPU runs): tests compare every bf16 value under every scale, in every
 * variant this CPU runs. Rows whose largest magnitude is below 2 ** -93 are left to the
 * definition (`fallback`): bf16 subnormals matter there, and the kernel flushes them.
 *
 * One build holds a variant per x86-64 instruction set (AVX-512, AVX2, the baseline), picked
 * when the module loads. Why C, and its speed: docs/benchmarks.md (fp8_writer_vs_bf16_writer).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

enum {
    SMALLEST_EXPONENT = -92, /* frexp exponent of the smallest max |x| the kernel takes */
    SCALE_EXPONENT_OFFSET = 8, /* hsx_store/fp8.py */
    TOP_EXPONENT = 128,
    TOP_LIMIT_BITS = 0x77, /* 240: the top binade saturates there (hsx_store/fp8.py) */
    E4M3_MAX_BITS = 0x7E, /* 448 */
    LANES = 32,
    PREFETCH_BYTES = 8192,
};

/* 32 lanes of 16 bits: GCC's (and Clang's) vector extensions, so that every step stays 16 bits
 * wide (C would widen it); each variant lowers them for its instruction set. They are passed
 * only to inlined functions (the build silences -Wpsabi's note on their ABI). */
typedef uint16_t u16x32 __attribute__((vector_size(64)));
typedef int16_t i16x32 __attribute__((vector_size(64)));
typedef uint32_t u32x32 __attribute__((vector_size(128)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));
#define INLINE static inline __attribute__((always_inline))

/* `avx512`: the variant's target has 512-bit vectors of 16-bit lanes, with comparisons and
 * shifts by per-lane counts (AVX-512BW). Without it, the lanes are widened to 32 bits for the
 * shifts (x86 has no other per-lane 16-bit shift: emulated, they cost ~10x), and comparisons
 * are arithmetic (GCC lowers vector comparisons wider than the target's one lane at a time,
 * as slow). */

/* All ones where a < b; for |a - b| < 2 ** 15, as every pair here is. */
INLINE i16x32 less(i16x32 a, i16x32 b, int avx512)
{
    return avx512 ? a < b : (a - b) >> 15;
}

INLINE i16x32 min_i16(i16x32 a, i16x32 b, int avx512)
{
    const i16x32 a_less = less(a, b, avx512);
    return (a & a_less) | (b & ~a_less);
}

INLINE i16x32 max_i16(i16x32 a, i16x32 b, int avx512)
{
    const i16x32 a_less = less(a, b, avx512);
    return (b & a_less) | (a & ~a_less);
}

INLINE u16x32 load_lanes(const int16_t *from, Py_ssize_t count)
{
    u16x32 b = {0}; /* padded with zeros: they change no maximum and are not stored */
    memcpy(&b, from, (size_t)count * sizeof from[0]);
    return b;
}

/* x >> by, lane by lane. */
INLINE u16x32 shift_right(u16x32 x, u16x32 by, int avx512)
{
    if (avx512)
        return x >> by;
    const u32x32 wide = __builtin_convertvector(x, u32x32) >> __builtin_convertvector(by, u32x32);
    return __builtin_convertvector(wide, u16x32);
}

/* e4m3 bits of 32 values (bf16 bits b) of a row scaled by 2 ** k; shifted: (k - 120) << 7,
 * top: the largest bits allowed. */
INLINE u8x32 quantize_lanes(u16x32 b, u16x32 shifted, i16x32 top, int avx512)
{
    const u16x32 m = b & 0x7FFF;
    /* The magnitude's bits rebased: exponent field t = e4m3's biased exponent (<= 0 for e4m3
     * subnormals), 7 mantissa bits. */
    const i16x32 m2 = (i16x32)(m + shifted);
    /* e4m3 normal: round the 7 mantissa bits to 3, nearest even; a carry moves into the
     * exponent as it should. */
    const u16x32 normal = ((u16x32)m2 + 7 + (((u16x32)m2 >> 4) & 1)) >> 4;
    /* e4m3 subnormal: (128 + mantissa) * 2 ** (t - 5) units of 2 ** -9, nearest even, as
     * ((128 + mantissa) << 4 >> -t) / 2 ** 9; 0 from t = -5 down (zeros and bf16 subnormals
     * are far below). Lanes that are normal get some shift in range too, and are not used. */
    const u16x32 down = (u16x32)min_i16(-(m2 >> 7), (i16x32){0} + 5, avx512) & 15;
    const u16x32 w = shift_right((128 + (m & 0x7F)) << 4, down, avx512);
    const u16x32 sub = (w + 255 + ((w >> 9) & 1)) >> 9;
    const u16x32 is_normal = (u16x32)less((i16x32){0} + 127, m2, avx512);
    const i16x32 either = (i16x32)((normal & is_normal) | (sub & ~is_normal));
    const u16x32 q = (u16x32)min_i16(either, top, avx512);
    return __builtin_convertvector(q | ((b >> 8) & 0x80), u8x32);
}

/* One row of h values: e4m3 bits into `out` for a row whose frexp exponent of max |x| is e.
 * Returns the largest magnitude (bits) of the row `next`, read in the same loop, prefetched
 * 8 KiB ahead: its loads from memory overlap this row's arithmetic (~1.7x faster than a pass
 * of its own before each row: docs/benchmarks.md, fp8_writer_vs_bf16_writer). */
INLINE int16_t quantize_row(const int16_t *restrict row, uint8_t *restrict out, Py_ssize_t h,
                            int e, const int16_t *next, int avx512)
{
    const int k = SCALE_EXPONENT_OFFSET - e; /* x / scale = x * 2 ** k */
    const u16x32 shifted = (u16x32){0} + (uint16_t)((k - 120) * 128);
    const i16x32 top = (i16x32){0} + (int16_t)(e >= TOP_EXPONENT ? TOP_LIMIT_BITS : E4M3_MAX_BITS);
    i16x32 amax = {0};
    Py_ssize_t j = 0;
    for (; j + LANES <= h; j += LANES) {
        const u8x32 q = quantize_lanes(load_lanes(row + j, LANES), shifted, top, avx512);
        memcpy(out + j, &q, sizeof q);
        amax = max_i16(amax, (i16x32)(load_lanes(next + j, LANES) & 0x7FFF), avx512);
        /* Never faults, even past the end (an address as an integer: no pointer beyond it). */
        __builtin_prefetch((const void *)((uintptr_t)(next + j) + PREFETCH_BYTES));
    }
    if (j < h) { /* the last lanes */
        const u8x32 q = quantize_lanes(load_lanes(row + j, h - j), shifted, top, avx512);
        memcpy(out + j, &q, (size_t)(h - j));
        amax = max_i16(amax, (i16x32)(load_lanes(next + j, h - j) & 0x7FFF), avx512);
    }
    int16_t largest = 0;
    for (int lane = 0; lane < LANES; lane++)
        largest = amax[lane] > largest ? amax[lane] : largest;
    return largest;
}

INLINE int16_t row_amax(const int16_t *row, Py_ssize_t h)
{
    int16_t amax = 0;
    for (Py_ssize_t j = 0; j < h; j++) {
        const int16_t m = (int16_t)(row[j] & 0x7FFF); /* magnitudes order like their bits */
        amax = m > amax ? m : amax;
    }
    return amax;
}

/* Returns the first non-finite row, or -1. */
INLINE Py_ssize_t quantize_rows(const int16_t *bits, uint8_t *out, float *scales,
                                uint8_t *fallback, Py_ssize_t n, Py_ssize_t h, int avx512)
{
    int16_t amax = n ? row_amax(bits, h) : 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        const int16_t *row = bits + r * h;
        const int16_t *next = r + 1 < n ? row + h : row; /* the last row: read again, unused */
        if (amax >= 0x7F80) /* exponent all ones: inf or NaN */
            return r;
        const int e = amax ? (amax >> 7) - 126 : 0; /* max |x| = m * 2 ** e, 0.5 <= m < 1 */
        fallback[r] = amax > 0 && e < SMALLEST_EXPONENT;
        if (fallback[r]) {
            amax = row_amax(next, h);
            continue;
        }
        scales[r] = amax ? ldexpf(1.0f, e - SCALE_EXPONENT_OFFSET) : 0.0f;
        amax = quantize_row(row, out + r * h, h, e, next, avx512);
    }
    return -1;
}

/* The variants: the same code, compiled for each instruction set. */
typedef Py_ssize_t (*kernel_fn)(const int16_t *, uint8_t *, float *, uint8_t *, Py_ssize_t,
                                Py_ssize_t);
#define VARIANT(name, target, avx512)                                                          \
    target static Py_ssize_t name(const int16_t *bits, uint8_t *out, float *scales,          \
                                  uint8_t *fallback, Py_ssize_t n, Py_ssize_t h)             \
    {                                                                                         \
        return quantize_rows(bits, out, scales, fallback, n, h, avx512);                       \
    }

#if defined(__x86_64__) && defined(__GNUC__)
/* Each variant's instruction sets, by feature: GCC >= 9 and Clang >= 10 know these names both in
 * target attributes and in __builtin_cpu_supports (level names, "x86-64-v4", need GCC 12 and
 * Clang 18 there). The lists are x86-64-v4's and x86-64-v3's less F16C, LZCNT, MOVBE and XSAVE,
 * which GCC 9's builtin cannot test and this code never uses: GCC 12 compiles each variant to the
 * bytes the level names gave. The builtin also checks that the OS saves the wider registers. */
#define AVX2_FEATURES(_)                                                                      \
    _(avx2) _(avx) _(fma) _(bmi) _(bmi2) _(popcnt) _(sse4.2) _(sse4.1) _(ssse3) _(sse3)
#define AVX512_FEATURES(_)                                                                    \
    _(avx512f) _(avx512bw) _(avx512cd) _(avx512dq) _(avx512vl) AVX2_FEATURES(_)
#define COMMA_FEATURE(feature) "," #feature
#define AND_CPU_HAS(feature) && __builtin_cpu_supports(#feature)
/* "sse2,avx2,avx,...": SSE2 (every x86-64 has it) heads the list, which takes no empty item. */
#define TARGET(features) __attribute__((target("sse2" features(COMMA_FEATURE))))
VARIANT(quantize_avx512, TARGET(AVX512_FEATURES), 1)
VARIANT(quantize_avx2, TARGET(AVX2_FEATURES), 0)
VARIANT(quantize_baseline, , 0)
static struct {
    const char *name;
    kernel_fn fn;
    int supported; /* by this CPU: set when the module loads */
} VARIANTS[] = {
    {"avx512", quantize_avx512, 0},
    {"avx2", quantize_avx2, 0},
    {"baseline", quantize_baseline, 1},
};
static void find_supported(void)
{
    __builtin_cpu_init();
    VARIANTS[0].supported = 1 AVX512_FEATURES(AND_CPU_HAS);
    VARIANTS[1].supported = 1 AVX2_FEATURES(AND_CPU_HAS);
}
#else /* other CPUs: one variant */
VARIANT(quantize_baseline, , 0)
static struct {
    const char *name;
    kernel_fn fn;
    int supported;
} VARIANTS[] = {{"baseline", quantize_baseline, 1}};
static void find_supported(void) {}
#endif
enum { NUM_VARIANTS = sizeof VARIANTS / sizeof VARIANTS[0] };

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize,
                      int ndim, const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->itemsize != itemsize || view->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d-d items of %zd bytes, got %d-d of %zd",
                     name, ndim, itemsize, view->ndim, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(quantize_bf16_rows_doc,
             "quantize_bf16_rows(bits, out, scales, fallback, variant=None) -> int\n\n"
             "bits int16 [n, h] (bf16) -> out uint8 [n, h] (e4m3), scales float32 [n];\n"
             "fallback bool [n]: the rows left to the definition. Returns the first\n"
             "non-finite row (the rows after it are not quantized), or -1. C-contiguous\n"
             "arrays; the GIL is released while it runs. variant: one of variants()\n"
             "(tests compare them), else the first.");

static PyObject *quantize_bf16_rows(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *objs[4], *result = NULL;
    const char *variant = NULL;
    if (!PyArg_ParseTuple(args, "OOOO|z:quantize_bf16_rows", &objs[0], &objs[1], &objs[2],
                          &objs[3], &variant))
        return NULL;
    kernel_fn kernel = NULL;
    for (int i = 0; i < NUM_VARIANTS && kernel == NULL; i++)
        if (VARIANTS[i].supported && (variant == NULL || strcmp(variant, VARIANTS[i].name) == 0))
            kernel = VARIANTS[i].fn;
    if (kernel == NULL)
        return PyErr_Format(PyExc_ValueError, "variant %s: not one this CPU runs", variant);
    Py_buffer bits, out, scales, fallback;
    if (get_buffer(objs[0], &bits, 0, 2, 2, "bits") < 0)
        return NULL;
    if (get_buffer(objs[1], &out, 1, 1, 2, "out") < 0)
        goto release_bits;
    if (get_buffer(objs[2], &scales, 1, 4, 1, "scales") < 0)
        goto release_out;
    if (get_buffer(objs[3], &fallback, 1, 1, 1, "fallback") < 0)
        goto release_scales;
    const Py_ssize_t n = bits.shape[0], h = bits.shape[1];
    if (out.shape[0] != n || out.shape[1] != h || scales.shape[0] != n ||
        fallback.shape[0] != n) {
        PyErr_SetString(PyExc_ValueError,
                        "out [n, h], scales [n] and fallback [n] must match bits [n, h]");
    } else {
        Py_ssize_t bad;
        Py_BEGIN_ALLOW_THREADS
        bad = kernel(bits.buf, out.buf, scales.buf, fallback.buf, n, h);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(bad);
    }
    PyBuffer_Release(&fallback);
release_scales:
    PyBuffer_Release(&scales);
release_out:
    PyBuffer_Release(&out);
release_bits:
    PyBuffer_Release(&bits);
    return result;
}

PyDoc_STRVAR(variants_doc, "variants() -> tuple[str, ...]\n\n"
                           "The kernel's variants this CPU runs, fastest first.");

static PyObject *variants(PyObject *self, PyObject *unused)
{
    (void)self, (void)unused;
    PyObject *names = PyList_New(0);
    for (int i = 0; names != NULL && i < NUM_VARIANTS; i++) {
        if (!VARIANTS[i].supported)
            continue;
        PyObject *name = PyUnicode_FromString(VARIANTS[i].name);
        if (name == NULL || PyList_Append(names, name) < 0)
            Py_CLEAR(names);
        Py_XDECREF(name);
    }
    PyObject *result = names ? PyList_AsTuple(names) : NULL;
    Py_XDECREF(names);
    return result;
}

static PyMethodDef methods[] = {
    {"quantize_bf16_rows", quantize_bf16_rows, METH_VARARGS, quantize_bf16_rows_doc},
    {"variants", variants, METH_NOARGS, variants_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fp8_cpu",
    .m_doc = "The CPU quantizer's kernel: bf16 rows to e4m3 bits and power-of-two scales.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit_fp8_cpu(void)
{
    find_supported();
    return PyModule_Create(&module);
}

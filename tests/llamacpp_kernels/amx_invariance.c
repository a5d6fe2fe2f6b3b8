// Batch invariance of ggml's AMX matmul (ggml-cpu/amx/mmq.cpp), through ggml's public API.
//
//   amx_invariance TYPE N NC THREADS [SEED]      TYPE: q4_0, q4_1, q8_0, q4_K, q5_K, q6_K, iq4_xs (or f16)
//
// A weight of NC rows x N columns, quantized to TYPE from random values, is placed in the "AMX" buffer type (one of
// the CPU backend's extra buffer types, llama.cpp's `use_extra_bufts`, on CPUs with AMX-INT8 and builds with
// __AMX_INT8__ and __AVX512VNNI__) and multiplied with M = 1..40 random activation rows. Row r of every M-row product
// must be bitwise the product of row r alone (a 1-row forward). ggml_backend_amx_mul_mat multiplies one row with
// the AVX512-VNNI kernel (tinygemm_kernel_vnni, 64 weight rows at a time) and more rows with AMX tiles
// (tinygemm_kernel_amx, blocks of 32 activation rows x 32 weight rows; a block of fewer rows is unpacked), so
// M = 1..40 covers the one-row kernel, tile blocks of 2..31 rows, a full 32-row block and a full block plus a tail.
// (An f16 weight in the AMX buffer is multiplied by tinygemm_kernel_avx, in blocks of 4 rows x 6 weight rows, on
// the float activations.)
// NC must be a multiple of 32 (llama.cpp does not place other weights in the AMX buffer), N a multiple of 32
// (q4_0, q4_1, q8_0) or 256 (the K-quants, iq4_xs).
// Also printed: the largest difference of the 40-row product from a double-precision product of the dequantized
// weight and the activations as the kernels quantize them (relative to the largest product), a sanity check that
// the kernels compute the product.
//
// Output: one line per M: "width M rows_differing R max_abs_diff D"; then "reference_max_rel_diff X".
// Exit status: 0 all bitwise, 1 some row differs, 2 cannot test here (no AMX buffer type in this build or on this
// CPU), 3 usage or setup error.
#include "ggml_check.h"

#include <math.h>

#define MAX_ROWS 40

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s TYPE N NC THREADS [SEED]\n", argv[0]);
        return 3;
    }
    static const struct { const char * name; enum ggml_type type; } types[] = {
        { "q4_0", GGML_TYPE_Q4_0 }, { "q4_1", GGML_TYPE_Q4_1 }, { "q8_0", GGML_TYPE_Q8_0 },
        { "q4_K", GGML_TYPE_Q4_K }, { "q5_K", GGML_TYPE_Q5_K }, { "q6_K", GGML_TYPE_Q6_K },
        { "iq4_xs", GGML_TYPE_IQ4_XS }, { "f16", GGML_TYPE_F16 },
    };
    int t = 0;
    while (t < (int) (sizeof types / sizeof types[0]) && strcmp(argv[1], types[t].name) != 0) t++;
    if (t == (int) (sizeof types / sizeof types[0])) { fprintf(stderr, "unknown type %s\n", argv[1]); return 3; }
    const enum ggml_type type = types[t].type;
    const int n = atoi(argv[2]), nc = atoi(argv[3]), threads = atoi(argv[4]);
    rng_state = argc > 5 ? strtoull(argv[5], NULL, 10) * 0x9E3779B97F4A7C15ULL + 1 : 88172645463325252ULL;
    if (n <= 0 || nc <= 0 || threads <= 0 || n % ggml_blck_size(type) != 0 || n % 32 != 0 || nc % 32 != 0) {
        fprintf(stderr, "N must be a multiple of %d and of 32, NC a multiple of 32\n", (int) ggml_blck_size(type));
        return 3;
    }

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, threads);
    ggml_backend_buffer_type_t amx = extra_buffer_type("AMX");
    if (!amx) {
        printf("no AMX buffer type in this build or on this CPU\n");
        return 2;
    }

    // weights: random, a few rows scaled up so that the per-block scales vary
    float * wf = malloc(sizeof(float) * (size_t) n * nc);
    for (size_t i = 0; i < (size_t) n * nc; i++) wf[i] = uniform() * (i % 97 == 0 ? 4.0f : 1.0f);
    const size_t qsize = ggml_row_size(type, n) * nc;
    void * q = malloc(qsize);
    ggml_quantize_chunk(type, wf, q, 0, nc, n, NULL);

    struct ggml_init_params wparams = { ggml_tensor_overhead() * 2, NULL, true };
    struct ggml_context * ctx_w = ggml_init(wparams);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx_w, type, n, nc);
    ggml_backend_buffer_t buf_w = ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, amx);
    if (!buf_w || w->extra == NULL) {
        printf("%s %dx%d is not placed in the AMX buffer on this CPU\n", argv[1], nc, n);
        return 2;
    }
    ggml_backend_tensor_set(w, q, 0, qsize);   // the AMX buffer's set_tensor packs the weight for the kernels

    // activations: random, with some large values (as hidden states have)
    float * x = malloc(sizeof(float) * (size_t) n * MAX_ROWS);
    for (size_t i = 0; i < (size_t) n * MAX_ROWS; i++) x[i] = uniform() * (i % 61 == 0 ? 8.0f : 1.0f);

    float * single = malloc(sizeof(float) * (size_t) nc * MAX_ROWS);   // row r computed alone
    for (int r = 0; r < MAX_ROWS; r++) matmul(backend, w, x + (size_t) r * n, n, 1, single + (size_t) r * nc);

    float * got = malloc(sizeof(float) * (size_t) nc * MAX_ROWS);
    int bad = 0;
    for (int m = 1; m <= MAX_ROWS; m++) {
        matmul(backend, w, x, n, m, got);
        int rows = 0;
        double worst = 0.0;
        for (int r = 0; r < m; r++) {
            const float * a = got + (size_t) r * nc, * b = single + (size_t) r * nc;
            if (memcmp(a, b, sizeof(float) * nc) != 0) rows++;
            for (int j = 0; j < nc; j++) worst = fmax(worst, fabs((double) a[j] - b[j]));
        }
        printf("width %d rows_differing %d max_abs_diff %.9g\n", m, rows, worst);
        bad |= rows != 0;
    }

    // sanity: a double-precision product of the dequantized weight and the activations quantized as the kernels
    // quantize them (to the type's vec_dot type) is nearly the same
    // (f16: the AMX buffer's kernel takes the float activations as they are)
    const enum ggml_type act_type = type == GGML_TYPE_F16 ? GGML_TYPE_F32 : ggml_get_type_traits_cpu(type)->vec_dot_type;
    float * wd = malloc(sizeof(float) * (size_t) n * nc);
    float * xd = malloc(sizeof(float) * (size_t) n * MAX_ROWS);
    void * xq = malloc(ggml_row_size(act_type, n) * MAX_ROWS);
    ggml_get_type_traits(type)->to_float(q, wd, (int64_t) n * nc);
    if (act_type == GGML_TYPE_F32) {
        memcpy(xd, x, sizeof(float) * (size_t) n * MAX_ROWS);
    } else {
        for (int r = 0; r < MAX_ROWS; r++) {      // as the kernels quantize activations, row by row
            ggml_get_type_traits_cpu(act_type)->from_float(x + (size_t) r * n, (char *) xq + ggml_row_size(act_type, n) * r, n);
        }
        dequantize(act_type, xq, xd, (int64_t) n * MAX_ROWS);
    }
    double rel = 0.0, scale = 0.0;
    for (int r = 0; r < MAX_ROWS; r++) {
        for (int j = 0; j < nc; j++) {
            double ref = 0.0;
            for (int i = 0; i < n; i++) ref += (double) wd[(size_t) j * n + i] * xd[(size_t) r * n + i];
            scale = fmax(scale, fabs(ref));
            rel = fmax(rel, fabs(ref - got[(size_t) r * nc + j]));
        }
    }
    printf("reference_max_rel_diff %.3g\n", scale > 0 ? rel / scale : 0.0);

    ggml_backend_buffer_free(buf_w);
    ggml_free(ctx_w);
    free(wd); free(xd); free(xq);
    ggml_backend_free(backend);
    free(wf); free(q); free(x); free(single); free(got);
    return bad;
}

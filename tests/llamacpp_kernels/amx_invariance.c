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

    size_t qsize;
    void * q = random_quantized_weight(type, n, nc, &qsize);

    struct ggml_context * ctx_w;
    ggml_backend_buffer_t buf_w;
    struct ggml_tensor * w = weight(amx, type, n, nc, &ctx_w, &buf_w);
    if (!buf_w || w->extra == NULL) {
        printf("%s %dx%d is not placed in the AMX buffer on this CPU\n", argv[1], nc, n);
        return 2;
    }
    ggml_backend_tensor_set(w, q, 0, qsize);   // the AMX buffer's set_tensor packs the weight for the kernels

    const int bad = check_rows(backend, w, type, q, n, nc, MAX_ROWS);

    ggml_backend_buffer_free(buf_w);
    ggml_free(ctx_w);
    ggml_backend_free(backend);
    free(q);
    return bad;
}

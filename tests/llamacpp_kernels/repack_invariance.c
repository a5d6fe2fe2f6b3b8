// Batch invariance of ggml's CPU matmul kernels that paraspec's patches make invariant, through ggml's public API.
//
//   repack_invariance TYPE N NC THREADS [SEED]      TYPE: q4_K, q4_0, iq4_nl (repacked), q6_K, q4_K-tiled (tiled)
//
// A weight of NC rows x N columns, quantized to TYPE from random values, is multiplied with M = 1..16 random
// activation rows. Row r of every M-row product must be bitwise the product of row r alone (a 1-row forward).
// - q4_K, q4_0, iq4_nl: the weight is placed in the CPU_REPACK buffer (llama.cpp's `use_extra_bufts`); ggml's
//   repack path sends M - M % 4 rows to a 4-row `gemm` (activations quantized 4 rows at a time) and the rest, one
//   by one, to `gemv`.
// - q6_K, q4_K-tiled: the weight is in the plain CPU buffer (x86 does not repack Q6_K; a Q4_K weight there is
//   one llama.cpp did not repack, e.g. a tied embedding); from 8 rows on ggml multiplies it with the tiled K-quant
//   matmul (ggml-cpu/tiled/, unless GGML_CPU_TILED_MM=0), below with ggml_vec_dot_q6_K_q8_K / _q4_K_q8_K.
// Also printed: the largest difference of the 16-row product from a double-precision product of the dequantized
// weight and the activations as the kernels quantize them, a sanity check that the kernels compute the product.
//
// Output: one line per M: "width M rows_differing R max_abs_diff D"; then "reference_max_rel_diff X".
// Exit status: 0 all bitwise, 1 some row differs, 2 cannot test here (the weight is not repacked on this CPU).
#include "ggml_check.h"

#define MAX_ROWS 16

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s TYPE N NC THREADS [SEED]\n", argv[0]);
        return 3;
    }
    enum ggml_type type;
    if (strcmp(argv[1], "q4_K") == 0 || strcmp(argv[1], "q4_K-tiled") == 0) type = GGML_TYPE_Q4_K;
    else if (strcmp(argv[1], "q4_0") == 0) type = GGML_TYPE_Q4_0;
    else if (strcmp(argv[1], "iq4_nl") == 0) type = GGML_TYPE_IQ4_NL;
    else if (strcmp(argv[1], "q6_K") == 0) type = GGML_TYPE_Q6_K;
    else { fprintf(stderr, "unknown type %s\n", argv[1]); return 3; }
    const int n = atoi(argv[2]), nc = atoi(argv[3]), threads = atoi(argv[4]);
    rng_state = argc > 5 ? strtoull(argv[5], NULL, 10) * 0x9E3779B97F4A7C15ULL + 1 : 88172645463325252ULL;

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, threads);
    // tested on the plain buffer (the tiled matmul), not repacked
    const int tiled = type == GGML_TYPE_Q6_K || strcmp(argv[1], "q4_K-tiled") == 0;
    ggml_backend_buffer_type_t repack = extra_buffer_type("CPU_REPACK");
    if (!repack && !tiled) {
        printf("no CPU_REPACK buffer type in this build\n");
        return 2;
    }

    size_t qsize;
    void * q = random_quantized_weight(type, n, nc, &qsize);

    struct ggml_context * ctx_w;
    ggml_backend_buffer_t buf_w;
    struct ggml_tensor * w = weight(tiled ? ggml_backend_cpu_buffer_type() : repack, type, n, nc, &ctx_w, &buf_w);
    if (!tiled && w->extra == NULL) {
        printf("%s %dx%d is not repacked on this CPU\n", argv[1], nc, n);
        return 2;
    }
    ggml_backend_tensor_set(w, q, 0, qsize);   // the repack buffer's set_tensor repacks

    const int bad = check_rows(backend, w, type, q, n, nc, MAX_ROWS);

    ggml_backend_buffer_free(buf_w);
    ggml_free(ctx_w);
    ggml_backend_free(backend);
    free(q);
    return bad;
}

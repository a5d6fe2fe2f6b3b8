// Batch invariance of ggml's repacked ("extra buffer") CPU matmul kernels, through ggml's public API.
//
//   repack_invariance TYPE N NC THREADS [SEED]      TYPE: q4_K, q4_0, iq4_nl
//
// A weight of NC rows x N columns, quantized to TYPE from random values, is placed in the CPU_REPACK buffer
// (llama.cpp's `use_extra_bufts`), and multiplied with M = 1..16 random activation rows. ggml's repack path
// sends M - M % 4 rows to a 4-row `gemm` (activations quantized 4 rows at a time) and the rest, one by one, to
// `gemv`. Row r of every M-row product must be bitwise the product of row r alone (a 1-row forward: gemv).
// Also printed: the largest difference from the same product on the plain (not repacked) buffer, a sanity
// check that the repacked kernels compute the product at all.
//
// Output: one line per M: "width M rows_differing R max_abs_diff D"; then "plain_max_rel_diff X".
// Exit status: 0 all bitwise, 1 some row differs, 2 cannot test here (the weight is not repacked on this CPU).
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 16

static uint64_t rng_state;

static float uniform(void) {  // [-1, 1), xorshift64*
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return (float) ((rng_state * 2685821657736338717ULL) >> 40) / (float) (1 << 23) - 1.0f;
}

static ggml_backend_buffer_type_t repack_buffer_type(void) {
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
    ggml_backend_dev_get_extra_bufts_t get =
        (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t * b = get ? get(dev) : NULL; b && *b; b++) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
            return *b;
        }
    }
    return NULL;
}

// w (in its buffer) times the first m rows of x; the result, m rows of nc floats, into out
static void matmul(ggml_backend_t backend, struct ggml_tensor * w, const float * x, int n, int m, float * out) {
    struct ggml_init_params params = { ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, m);
    struct ggml_tensor * y = ggml_mul_mat(ctx, w, xt);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    ggml_backend_tensor_set(xt, x, 0, ggml_nbytes(xt));
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "graph compute failed\n");
        exit(3);
    }
    ggml_backend_tensor_get(y, out, 0, ggml_nbytes(y));
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

// an empty weight tensor of `type` in a buffer of `buft` (its context and buffer are returned too)
static struct ggml_tensor * weight(ggml_backend_buffer_type_t buft, enum ggml_type type, int n, int nc,
                                   struct ggml_context ** ctx_out, ggml_backend_buffer_t * buf_out) {
    struct ggml_init_params params = { ggml_tensor_overhead() * 2, NULL, true };
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, type, n, nc);
    *buf_out = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    *ctx_out = ctx;
    return w;
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s TYPE N NC THREADS [SEED]\n", argv[0]);
        return 3;
    }
    enum ggml_type type;
    if (strcmp(argv[1], "q4_K") == 0) type = GGML_TYPE_Q4_K;
    else if (strcmp(argv[1], "q4_0") == 0) type = GGML_TYPE_Q4_0;
    else if (strcmp(argv[1], "iq4_nl") == 0) type = GGML_TYPE_IQ4_NL;
    else { fprintf(stderr, "unknown type %s\n", argv[1]); return 3; }
    const int n = atoi(argv[2]), nc = atoi(argv[3]), threads = atoi(argv[4]);
    rng_state = argc > 5 ? strtoull(argv[5], NULL, 10) * 0x9E3779B97F4A7C15ULL + 1 : 88172645463325252ULL;

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, threads);
    ggml_backend_buffer_type_t repack = repack_buffer_type();
    if (!repack) {
        printf("no CPU_REPACK buffer type in this build\n");
        return 2;
    }

    // weights: random, a few rows scaled up so that the per-block scales vary
    float * wf = malloc(sizeof(float) * (size_t) n * nc);
    for (size_t i = 0; i < (size_t) n * nc; i++) wf[i] = uniform() * (i % 97 == 0 ? 4.0f : 1.0f);
    const size_t qsize = ggml_row_size(type, n) * nc;
    void * q = malloc(qsize);
    ggml_quantize_chunk(type, wf, q, 0, nc, n, NULL);

    struct ggml_context * ctx_r, * ctx_p;
    ggml_backend_buffer_t buf_r, buf_p;
    struct ggml_tensor * w_r = weight(repack, type, n, nc, &ctx_r, &buf_r);
    struct ggml_tensor * w_p = weight(ggml_backend_cpu_buffer_type(), type, n, nc, &ctx_p, &buf_p);
    if (w_r->extra == NULL) {
        printf("%s %dx%d is not repacked on this CPU\n", argv[1], nc, n);
        return 2;
    }
    ggml_backend_tensor_set(w_r, q, 0, qsize);   // the repack buffer's set_tensor repacks
    ggml_backend_tensor_set(w_p, q, 0, qsize);

    // activations: random, with some large values (as hidden states have)
    float * x = malloc(sizeof(float) * (size_t) n * MAX_ROWS);
    for (size_t i = 0; i < (size_t) n * MAX_ROWS; i++) x[i] = uniform() * (i % 61 == 0 ? 8.0f : 1.0f);

    float * single = malloc(sizeof(float) * (size_t) nc * MAX_ROWS);   // row r computed alone
    for (int r = 0; r < MAX_ROWS; r++) matmul(backend, w_r, x + (size_t) r * n, n, 1, single + (size_t) r * nc);

    float * got = malloc(sizeof(float) * (size_t) nc * MAX_ROWS);
    int bad = 0;
    for (int m = 1; m <= MAX_ROWS; m++) {
        matmul(backend, w_r, x, n, m, got);
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

    // sanity: the plain kernels (vec_dot) give nearly the same product
    matmul(backend, w_p, x, n, MAX_ROWS, got);
    double rel = 0.0, scale = 0.0;
    for (size_t i = 0; i < (size_t) nc * MAX_ROWS; i++) scale = fmax(scale, fabs(got[i]));
    for (size_t i = 0; i < (size_t) nc * MAX_ROWS; i++) rel = fmax(rel, fabs((double) got[i] - single[i]));
    printf("plain_max_rel_diff %.3g\n", scale > 0 ? rel / scale : 0.0);

    ggml_backend_buffer_free(buf_r);
    ggml_backend_buffer_free(buf_p);
    ggml_free(ctx_r);
    ggml_free(ctx_p);
    ggml_backend_free(backend);
    free(wf); free(q); free(x); free(single); free(got);
    return bad;
}
